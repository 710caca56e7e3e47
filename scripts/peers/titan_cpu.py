"""CPU smoke-test shim for torchtitan 0.2.2, which assumes CUDA when no accelerator is found: points its
device type and device module at the CPU (gloo), with memory figures of zero, and lets torch.histc count integer
indices on the CPU as torchtitan's router asks, builds the experts' permutation indices without
Triton, and has FSDP2 reduce gradients with SUM then divide (gloo has neither AVG nor PREMUL_SUM,
which FSDP2 picks for the expert-parallel run's fp32 gradients). Used only by titan_run.py --cpu,
never in a GPU measurement."""

from __future__ import annotations

import functools
import importlib
import types

import torch


def _cpu_module() -> types.SimpleNamespace:
    props = types.SimpleNamespace(total_memory=1, name="cpu")
    return types.SimpleNamespace(
        set_device=lambda *a: None,
        current_device=lambda: 0,
        device_count=lambda: 1,
        get_device_name=lambda *a: "cpu",
        get_device_properties=lambda *a: props,
        reset_peak_memory_stats=lambda *a: None,
        empty_cache=lambda: None,
        memory_stats=lambda *a: {},
        synchronize=lambda *a: None,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        is_available=lambda: True,
    )


def install() -> None:
    torch.histc = _histc_any_dtype(torch.histc)
    collectives = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_collectives")
    collectives._get_gradient_divide_factors = _sum_then_divide(collectives._get_gradient_divide_factors)
    moe_utils = importlib.import_module("torchtitan.models.moe.utils")  # its Triton index kernel needs a GPU
    moe_utils.generate_permute_indices = functools.partial(moe_utils.generate_permute_indices, use_cpu=True)
    module = _cpu_module()
    names = (
        "torchtitan.tools.utils",
        "torchtitan.components.metrics",
        "torchtitan.distributed.parallel_dims",
        "torchtitan.distributed.utils",
        "torchtitan.tools.profiling",
    )
    for name in names:
        mod = importlib.import_module(name)
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = module


def _sum_then_divide(factors):
    def wrapped(rs_group, ar_group, reduce_dtype, device_type="", factor=None, force_sum=False):
        return factors(rs_group, ar_group, reduce_dtype, device_type, factor, True)

    return wrapped


def _histc_any_dtype(histc):
    def wrapped(input, *args, **kwargs):  # noqa: A002  (torch's argument name)
        if not input.is_floating_point():  # histogram_cpu has no integer kernel; the router passes indices
            return histc(input.float(), *args, **kwargs).to(input.dtype)
        return histc(input, *args, **kwargs)

    return wrapped
