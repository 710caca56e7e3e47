"""The train step lowered for a GPU platform from any host, and the kernel calls it holds.

    exported = export_train_step(cfg, "rocm")        # on a CPU host, no GPU needed
    kernel_calls(exported.mlir_module())              # Counter({"xmoe_gmm": 6, "mha_forward": 1, ...})

CI has no AMD GPU; this is how it checks that the train step still lowers for one with every
kernel as a kernel (tests/test_lowering.py). Steps:
  1. build the step's pieces as the trainer does (mesh, model spec, optimizer, shardings),
     with abstract arrays for the state and batch: nothing is initialised or compiled;
  2. trace under `kernels.platform.target(platform)`, so the kernel backends and the
     attention backend are chosen for `platform` (Pallas through its Triton lowering,
     Pallas flash attention on ROCm, cuDNN on CUDA) instead of for this CPU host;
  3. `jax.export` for `platforms=[platform]`, allowing the GPU kernels' custom calls, which
     carry no serialization compatibility guarantee (this module is inspected, never run).
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter

import jax
from jax.export import DisabledSafetyCheck

from xmoe_jax.config import Config
from xmoe_jax.kernels.platform import runtime_platform, target
from xmoe_jax.sharding import make_mesh
from xmoe_jax.train import state as tstate
from xmoe_jax.train.step import batch_sharding, make_train_step

TRITON_CALL = "__gpu$xla.gpu.triton"  # a Pallas kernel lowered through Triton (CUDA or ROCm)
MOSAIC_GPU_CALL = "mosaic_gpu_v2"  # a Pallas kernel lowered through Mosaic GPU (NVIDIA)
CUDNN_ATTENTION_CALLS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
# the GPU kernels' custom calls that jax.export refuses by default (mosaic_gpu_v2 it allows)
_ALLOWED_CALLS = (TRITON_CALL, *CUDNN_ATTENTION_CALLS)

_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @([\w$.]+)\(.*")
_KERNEL_NAME = re.compile(r'\bname = "(\w+)"')


@contextlib.contextmanager
def _train_step(cfg: Config, platform: str, num_devices: int | None):
    """(jitted step, abstract (state, batch)) of `cfg`, inside its mesh and `target(platform)`."""
    mesh = make_mesh(cfg.mesh, jax.devices()[:num_devices])
    with target(platform), jax.set_mesh(mesh):
        layout = tstate.build(cfg, mesh)
        spec, optimizer, shardings, state = layout.spec, layout.optimizer, layout.shardings, layout.abstract()
        data_sh = batch_sharding(mesh, cfg)
        tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len), "int32", sharding=data_sh)
        yield (
            make_train_step(spec, optimizer, cfg, mesh, shardings),
            (state, {"inputs": tokens, "targets": tokens}),
        )


def export_train_step(cfg: Config, platform: str, num_devices: int | None = None) -> jax.export.Exported:
    """`cfg`'s jitted train step exported for `platform` ("rocm" or "cuda") from this host, on a
    mesh of this host's first `num_devices` devices (None: all).

    cuDNN attention exports only on one device: jax wraps it in `custom_partitioning`, whose
    sharding callbacks stay in Python (export refuses them) unless there is nothing to partition.
    """
    checks = [DisabledSafetyCheck.custom_call(name) for name in _ALLOWED_CALLS]
    with _train_step(cfg, platform, num_devices) as (step, args):
        return jax.export.export(step, platforms=[platform], disabled_checks=checks)(*args)


def compiled_train_step_text(cfg: Config, num_devices: int | None = None) -> str:
    """`cfg`'s train step compiled for this host (abstract inputs: nothing runs), as optimized HLO text."""
    with _train_step(cfg, runtime_platform(), num_devices) as (step, args):
        return step.lower(*args).compile().as_text()


def kernel_calls(module_text: str) -> Counter:
    """Kernel custom calls in a StableHLO module's text, one count per call op: Triton kernels
    under their kernel's name ("xmoe_gmm", "mha_forward"), every other custom call under its
    target ("__cudnn$fmhaSoftmax", "mosaic_gpu_v2", "Sharding", ...)."""
    calls: Counter = Counter()
    for match in _CUSTOM_CALL.finditer(module_text):
        call_target = match.group(1)
        if call_target == TRITON_CALL:
            name = _KERNEL_NAME.search(match.group(0))
            calls[name.group(1) if name else TRITON_CALL] += 1
        else:
            calls[call_target] += 1
    return calls
