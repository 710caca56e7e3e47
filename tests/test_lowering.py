"""The train step lowers for ROCm and CUDA from this CPU host, every kernel as a kernel.

A tiny pft config's jitted train step is exported (`jax.export`) for `platforms=["rocm"]` and
`["cuda"]` with the kernel backends chosen for that platform (perf/lowering.py). Every kernel
choice made while tracing is recorded: each grouped GEMM, permute and attention site must pick
its GPU backend (none may fall back to XLA), and the exported module must hold the custom
calls that backend lowers to (Triton kernels for gmm / tgmm / permute / combine and the Pallas
flash attention on ROCm; Triton kernels and cuDNN attention on CUDA). Exports only: nothing
compiles, ~10 s in all.
"""

from __future__ import annotations

import collections

import jax
import pytest

from xmoe_jax.config import load_config
from xmoe_jax.kernels import backends
from xmoe_jax.model import attention
from xmoe_jax.perf.lowering import CUDNN_ATTENTION_CALLS, export_train_step, kernel_calls

# one dense layer then 2 MoE layers in one scanned stack; sequence 128 = the flash block
OVERRIDES = [
    "parallel.dispatch=pft",
    "mesh.data=1",
    "train.batch_size=8",
    "train.seq_len=128",
    "model.dtype=bfloat16",  # cuDNN flash attention takes bf16/fp16 only
]
# devices (all on the expert axis): ROCm's 8 exchange tokens (one expert per device); cuDNN
# attention exports only unpartitioned (perf/lowering.py), so CUDA's step runs on one
NUM_DEVICES = {"rocm": 8, "cuda": 1}
# Triton kernels by name: the expert GEMMs and their gradients, permute / combine and their VJPs
MOE_KERNELS = {"xmoe_gmm", "xmoe_tgmm", "xmoe_scatter_rows", "xmoe_combine", "xmoe_gather_dot"}
PALLAS_ATTENTION = {"mha_forward", "mha_backward", "mha_preprocess_backward"}
GPU_BACKEND = {  # platform -> (kernel backend of every gmm/tgmm/permute call, attention backend)
    "rocm": ("pallas", "pallas"),
    "cuda": ("pallas", "cudnn"),
}


def _pretend_cudnn(mp: pytest.MonkeyPatch) -> None:
    """jax's cuDNN attention asks the installed cuDNN for its version while tracing; a CPU host
    has none, so answer with the GPU machines' (cuDNN 9.19). Skipped if jax moved the query."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
    except ImportError:
        pytest.skip("jax._src.cudnn.fused_attention_stablehlo moved: cannot trace cuDNN attention on CPU")
    if not hasattr(cudnn_attention, "check_cudnn_version"):
        pytest.skip("jax's cuDNN attention has no check_cudnn_version to answer on a CPU host")
    mp.setattr(cudnn_attention, "check_cudnn_version", lambda: 91900)


@pytest.fixture(scope="module", params=["rocm", "cuda"])
def exported(request):
    """(platform, kernel calls in the exported module, kernel choices made while tracing)."""
    platform = request.param
    choices: list[tuple[str, str]] = []
    choose_backend, choose_attention = backends.choose_backend, attention.choose

    def record_backend(implementation, call):
        backend = choose_backend(implementation, call)
        choices.append((call.op, backend.name))
        return backend

    def record_attention(implementation, q, k):
        impl = choose_attention(implementation, q, k)
        choices.append(("attention", impl))
        return impl

    with pytest.MonkeyPatch.context() as mp:
        if platform == "cuda":
            _pretend_cudnn(mp)
        mp.setattr(backends, "choose_backend", record_backend)
        mp.setattr(attention, "choose", record_attention)
        cfg = load_config("configs/tiny.yaml", [*OVERRIDES, f"mesh.expert={NUM_DEVICES[platform]}"])
        try:
            module = export_train_step(cfg, platform, NUM_DEVICES[platform]).mlir_module()
        except RuntimeError as err:
            if "No supported GPU devices found" not in str(err):
                raise
            # jax 0.12: Pallas's Triton lowering asks for a GPU device (or an abstract GPU mesh,
            # not wired here yet) even when exporting from a CPU host; jax 0.10/0.11 export fine
            pytest.skip(
                f"jax {jax.__version__}: Pallas's Triton lowering needs a GPU device to export ({err})"
            )
    return platform, kernel_calls(module), choices


def test_every_kernel_site_picks_its_gpu_backend(exported):
    platform, _, choices = exported
    kernel_backend, attention_backend = GPU_BACKEND[platform]
    ops = collections.Counter(op for op, _ in choices)
    assert ops["gmm"] and ops["tgmm"] and ops["permute"] and ops["attention"], ops
    # act_grad's platform default is XLA's one fused pass (faster than its Pallas kernel: kernels.md)
    expected = {"attention": attention_backend, "act_grad": "xla"}
    wrong = [(op, name) for op, name in choices if name != expected.get(op, kernel_backend)]
    assert not wrong, f"{platform}: kernel sites fell back: {collections.Counter(wrong)}"


def test_exported_module_holds_the_kernel_calls(exported):
    platform, calls, _ = exported
    # the routing weights' gradient comes from the experts' act_grad pass (<dy W^T, act>), never from a
    # gather_dot of the combine's rows: on one device (CUDA's export) the experts and the combine are one
    # custom VJP (moe/experts.py), and with an exchange (ROCm's) the weights travel with the rows and are
    # folded in on the expert side, so the combine is a plain sum. On one device the experts read token
    # rows through an index (gather on load), so no permute kernel runs at all
    one_device = {"xmoe_scatter_rows"} if NUM_DEVICES[platform] == 1 else set()
    expected = MOE_KERNELS - {"xmoe_gather_dot"} - one_device
    for name in expected:
        assert calls[name] >= 1, f"{platform}: no Triton call for {name}: {calls}"
    assert not calls["xmoe_gather_dot"], f"{platform}: the combine's weight gradient reads its rows: {calls}"
    if NUM_DEVICES[platform] == 1:
        assert not calls["xmoe_scatter_rows"], f"{platform}: a permute copy of the tokens is left: {calls}"
    # forward: 3 expert GEMMs (gate, up, down) of the scanned MoE layer; backward: the down
    # projection's input gradient and the up projections' one (gate and up concatenated along F),
    # and 2 weight-gradient tgmms (down; gate and up concatenated). The fused-activation kernels
    # (kernels/gmm/fused.py) are not wired into the layer: test_fused_activation_kernels_lower_through_triton_for_rocm.
    assert calls["xmoe_gmm"] == 5 and calls["xmoe_tgmm"] == 2, calls
    assert not calls["xmoe_gmm_act"] and not calls["xmoe_tgmm_act"], calls
    if platform == "rocm":
        assert PALLAS_ATTENTION <= set(calls), calls
        assert not set(CUDNN_ATTENTION_CALLS) & set(calls), calls
    else:
        assert all(calls[name] >= 1 for name in CUDNN_ATTENTION_CALLS), calls
        assert not PALLAS_ATTENTION & set(calls), calls


def _export_for_rocm(fn, args) -> collections.Counter:
    """Kernel calls of fn(*args) exported for ROCm from this CPU host (skips where this jax's Pallas
    Triton lowering needs a GPU device to export)."""
    from jax.export import DisabledSafetyCheck

    from xmoe_jax.kernels.platform import target
    from xmoe_jax.perf.lowering import TRITON_CALL

    with target("rocm"):
        try:
            exported = jax.export.export(
                jax.jit(fn),
                platforms=["rocm"],
                disabled_checks=[DisabledSafetyCheck.custom_call(TRITON_CALL)],
            )(*args)
        except RuntimeError as err:
            if "No supported GPU devices found" not in str(err):
                raise
            pytest.skip(
                f"jax {jax.__version__}: Pallas's Triton lowering needs a GPU device to export ({err})"
            )
    return kernel_calls(exported.mlir_module())


def test_row_indexed_kernels_lower_through_triton_for_rocm():
    """The gathered loads and scattered stores (gmm/schedule.py, tgmm's gathered chunks, the fill
    programs) lower through Pallas's Triton backend: jax.value_and_grad of a gmm that gathers lhs rows and
    scatters its output, exported for ROCm. Forward gmm + d lhs gmm (scattered, zero-filled) +
    d rhs tgmm (both operands gathered)."""
    import jax.numpy as jnp

    from xmoe_jax.kernels import gmm

    def loss(x, w, gs, src, dst):
        out = gmm(
            x,
            w,
            gs,
            lhs_rows_R=src,
            out_rows_R=dst,
            num_out_rows=96,
            distinct_rows=True,
            zero_unwritten=False,
        )
        return jnp.sum(out.astype(jnp.float32))

    args = (
        jax.ShapeDtypeStruct((80, 64), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 64, 32), jnp.bfloat16),
        jax.ShapeDtypeStruct((4,), jnp.int32),
        jax.ShapeDtypeStruct((72,), jnp.int32),
        jax.ShapeDtypeStruct((72,), jnp.int32),
    )
    calls = _export_for_rocm(jax.value_and_grad(loss, argnums=(0, 1)), args)
    assert calls["xmoe_gmm"] == 2 and calls["xmoe_tgmm"] == 1, calls


def test_fused_activation_kernels_lower_through_triton_for_rocm(monkeypatch):
    """The activation in a GEMM's load and in its store (kernels/gmm/fused.py, every op fused) lowers
    through Pallas's Triton backend for ROCm: the down-projection, its d hidden and its weight gradient."""
    import jax.numpy as jnp

    from xmoe_jax.kernels.gmm.fused import gmm_act, gmm_act_grad, tgmm_act

    monkeypatch.setenv("XMOE_FUSED_ACT", "kernel")

    def pieces(h, w, gs, rows, dy):
        y = gmm_act(h, w, gs, "swiglu", out_rows_R=rows, num_out_rows=96)
        dh = gmm_act_grad(dy, w, gs, h, "swiglu", lhs_rows_R=rows)
        return y, dh, tgmm_act(h, dy, gs, "swiglu", grad_rows_R=rows)

    bf16 = jnp.bfloat16
    args = (
        jax.ShapeDtypeStruct((72, 128), bf16),  # hidden [R, 2F], F = 64
        jax.ShapeDtypeStruct((4, 64, 32), bf16),
        jax.ShapeDtypeStruct((4,), jnp.int32),
        jax.ShapeDtypeStruct((72,), jnp.int32),
        jax.ShapeDtypeStruct((96, 32), bf16),
    )
    calls = _export_for_rocm(pieces, args)
    assert calls["xmoe_gmm_act"] == 2 and calls["xmoe_tgmm_act"] == 1, calls


def test_on_hopper_the_up_projections_weight_gradient_lowers_to_our_ws_tgmm():
    """The train step exported for CUDA as on a Hopper GPU (the device query answered; nothing runs):
    the contiguous expert GEMMs (and the down-projection's d act, on the rows gathered for its tgmm), and the
    up-projections' weight gradient (gate and up concatenated,
    [256, 256]) are our Mosaic-GPU `ws` kernels, the down-projection's ([128, 256], which its 256 x 128
    tile does not divide) stays a Triton tgmm (kernels/defaults.py: WS_TGMM_CONFIGS)."""
    from xmoe_jax.kernels import platform as kernel_platform

    choices: list[tuple[str, int, int, str]] = []
    choose_backend = backends.choose_backend

    def record_backend(implementation, call):
        backend = choose_backend(implementation, call)
        choices.append((call.op, call.k_dim, call.n_dim, backend.name))
        return backend

    with pytest.MonkeyPatch.context() as mp:
        _pretend_cudnn(mp)
        mp.setattr(kernel_platform, "_first_device_is_hopper", lambda: True)
        mp.setattr(backends, "choose_backend", record_backend)
        cfg = load_config(
            "configs/tiny.yaml",
            [*OVERRIDES, "mesh.expert=1", "model.hidden=256", "model.moe.expert_hidden=128"],
        )
        try:
            with pytest.warns(UserWarning, match="tgmm: implementation 'ws' unavailable"):
                module = export_train_step(cfg, "cuda", 1).mlir_module()
        except RuntimeError as err:
            if "No supported GPU devices found" not in str(err):
                raise
            pytest.skip(
                f"jax {jax.__version__}: Pallas's Triton lowering needs a GPU device to export ({err})"
            )
    tgmms = collections.Counter((k, n, name) for op, k, n, name in choices if op == "tgmm")
    assert tgmms == {(256, 256, "ws"): 1, (128, 256, "pallas"): 1}, tgmms
    calls = kernel_calls(module)
    mosaic = sum(count for name, count in calls.items() if name.startswith("mosaic_gpu"))
    # 3 ws gmm (the down-projection, the up-projections' d x, and the down-projection's d act, which reads the
    # dy rows XLA gathers for its tgmm: kernels.shared_rows) + the ws tgmm; the other tgmm on Triton, and the
    # forward's two up-projections gather on load (Triton)
    assert mosaic == 4 and calls["xmoe_tgmm"] == 1 and calls["xmoe_gmm"] == 2, calls
