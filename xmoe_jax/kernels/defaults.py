"""Measured choices beside the backend registry: default backend, tiles and launch parameters per platform.

Data only (and three look-ups), kept apart from backends.py so that retuning after a run of
scripts/bench_gmm.py touches numbers, not code. Keys are backend names of
backends.IMPLEMENTATIONS, platforms of platform.platform(), and ops "gmm", "tgmm", "permute".
"""

from __future__ import annotations

import os

from xmoe_jax.kernels.platform import is_hopper, platform

# Fastest measured backend per platform and op (scripts/bench_gmm.py, one H100, jax 0.11.2,
# X-MoE Small and Large expert shapes, bf16): pallas reached 74-87% of a same-shape dense
# matmul in fwd/dgrad/wgrad; triton (jax-triton) was within 0-8% of it but is an extra package;
# mgpu (JAX's untuned Mosaic ragged dots) 36-45% in fwd/dgrad, 51-70% in wgrad; XLA 1-3%.
# Permute/combine: pallas 80-82% of device-copy bandwidth, XLA's permute 46%.
# gmm on CUDA: our warp-specialized Mosaic kernel (ws, gmm/mgpu_ws.py) for contiguous rows, 1.03-1.17x
# pallas on one H200 (benchmarks/kernels.md, 2026-11-28); row-indexed calls (`gmm_indexed`) stay on
# pallas, which gathers on load. tgmm on CUDA: ws where WS_TGMM_CONFIGS' tile divides the output (the
# up-projection's dW: 1.15-1.20x pallas, the one-GPU step +1.25%; benchmarks/kernels.md, 2026-11-29), else
# pallas. ws needs Hopper: elsewhere it hands the call to pallas.
DEFAULT_IMPLEMENTATION = {
    "cpu": {"gmm": "xla", "tgmm": "xla", "gmm_fp8": "xla", "permute": "xla", "act_grad": "xla"},
    "cuda": {
        "gmm": "ws",
        "gmm_indexed": "pallas",
        "tgmm": "ws",
        "tgmm_indexed": "pallas",
        "gmm_fp8": "pallas",
        "permute": "pallas",
        "act_grad": "xla",
    },
    "rocm": {  # fp8: untested
        "gmm": "pallas",
        "tgmm": "pallas",
        "gmm_fp8": "pallas",
        "permute": "pallas",
        "act_grad": "xla",
    },
}

# (block_m, block_k, block_n) per (backend, platform) and op. For tgmm block_m is the chunk of
# rows reduced per step and (block_k, block_n) the output tile. Tests pass their own tiles.
# CUDA values: best of scripts/bench_gmm.py --sweep on one H100 (Small up-projection, bf16).
# gmm_fp8: block_k is 128, the blockwise recipe's K-block. Epilogue scales with float32 promotion
# every 128 of K ("gmm_fp8_promoted", the default recipes) ran fastest at (256, 128, 128); the
# tensor core's own accumulation (recipe fast_accum) and blockwise scales at (128, 128, 256)
# (scripts/bench_fp8.py --sweep, benchmarks/fp8.md).
_CUDA_TILES = {
    "gmm": (128, 64, 256),
    "tgmm": (64, 128, 256),
    # gmm/fused.py's ops (off by default): gmm's and tgmm's tiles, and a narrower N for the d hidden
    # epilogue, which holds the float32 accumulator and its gate and up tiles in registers at once
    "gmm_act": (128, 64, 256),
    "gmm_act_grad": (128, 64, 128),
    "tgmm_act": (64, 128, 256),
    "gmm_fp8": (128, 128, 256),
    "gmm_fp8_promoted": (256, 128, 128),
}
_CUDA_LAUNCH = {
    "gmm": (8, 4),
    "tgmm": (8, 3),
    "gmm_fp8": (8, 4),
    "gmm_fp8_promoted": (8, 3),
}  # (num_warps, num_stages)
# ROCm: untuned guesses sized for 64 KiB of LDS; measure before trusting.
_ROCM_TILES = {
    "gmm": (128, 64, 128),
    "tgmm": (64, 64, 128),
    "gmm_act": (128, 64, 128),
    "gmm_act_grad": (128, 64, 128),
    "tgmm_act": (64, 64, 128),
    "gmm_fp8": (128, 128, 128),
    "gmm_fp8_promoted": (128, 128, 128),
}
_ROCM_LAUNCH = {"gmm": (8, 2), "tgmm": (8, 2), "gmm_fp8": (8, 2), "gmm_fp8_promoted": (8, 2)}
DEFAULT_TILES = {
    ("pallas", "cpu"): {
        "gmm": (16, 16, 16),
        "tgmm": (16, 16, 16),
        "gmm_act": (16, 16, 16),
        "gmm_act_grad": (16, 16, 16),
        "tgmm_act": (16, 16, 16),
        "gmm_fp8": (16, 128, 16),
        "gmm_fp8_promoted": (16, 128, 16),
    },
    ("pallas", "cuda"): dict(_CUDA_TILES),
    ("triton", "cuda"): dict(_CUDA_TILES),
    ("mgpu", "cuda"): {"gmm": (128, 64, 128), "tgmm": (128, 64, 128)},
    ("pallas", "rocm"): dict(_ROCM_TILES),
    ("triton", "rocm"): dict(_ROCM_TILES),
}
# Triton launch parameters (num_warps, num_stages) per (backend, platform) and op.
LAUNCH = {
    ("pallas", "cuda"): dict(_CUDA_LAUNCH),
    ("triton", "cuda"): dict(_CUDA_LAUNCH),
    ("pallas", "rocm"): dict(_ROCM_LAUNCH),
    ("triton", "rocm"): dict(_ROCM_LAUNCH),
}
# ws (gmm/mgpu_ws.py) configs, by output columns: (tile_m, tile_n, tile_k, stages, split, snake, in_flight,
# epi_n). One H200, the Small expert shapes (scripts/bench_gmm_ws.py, results/gmm_ws_v2_1xh200.json):
# 128 x 256 CTAs where N allows (the down-projection: best of 11 configs for ep1 and ep4), else 256 x 128.
WS_CONFIGS = {
    256: (128, 128, 64, 4, "n", 8, 1, 64),
    128: (128, 128, 64, 4, "m", 8, 1, 64),
}


# ws tgmm (gmm/mgpu_ws_tgmm.py) configs, tried in order: the first whose CTA tile divides the [M, N] output.
# One H200 (scripts/bench_gmm_ws.py --op tgmm, results/tgmm_ws_1xh200.json): the 256 x 128 CTA split along M
# ran the up-projection's dW 1.15-1.20x the Pallas tgmm; 128 x 256 split along N ran the down-projection's
# 0.88-0.96x, so it is not offered (that shape stays on pallas). No wgmma in flight: the kernel's docstring.
WS_TGMM_CONFIGS = ((128, 128, 64, 4, "m", 8, 0, 64),)


def ws_tgmm_config(m_dim: int, n_dim: int):
    """The ws tgmm's config for an [M, N] weight gradient: the first of WS_TGMM_CONFIGS whose CTA tile
    divides it (else the last, which the kernel's shape_reason then refuses)."""
    from xmoe_jax.kernels.gmm.mgpu_ws import WsConfig

    configs = [WsConfig(*c) for c in WS_TGMM_CONFIGS]
    return next((c for c in configs if m_dim % c.cta_m == 0 and n_dim % c.cta_n == 0), configs[-1])


def ws_config(n_dim: int):
    """The ws kernel's config for N output columns: the widest CTA whose columns divide N."""
    from xmoe_jax.kernels.gmm.mgpu_ws import WsConfig

    cols = next((c for c in sorted(WS_CONFIGS, reverse=True) if n_dim % c == 0), min(WS_CONFIGS))
    return WsConfig(*WS_CONFIGS[cols])


# gmm_fp8 reads the weights K-major ([E, N, K], transposed where they are quantized): Hopper's FP8
# wgmma takes only K-major B from shared memory, so an N-major tile is transposed in the kernel.
FP8_WEIGHTS_KMAJOR = {"cuda": True}
SHARED_MEMORY_BYTES = {"cuda": 227 * 1024, "rocm": 64 * 1024}
# tgmm with row indices: gather inside the kernel (True) or let XLA gather the operands first and run
# the plain kernel (False). One H100, Small expert shapes (scripts/bench_gather_gmm.py,
# benchmarks/fused.md): the in-kernel gather is the faster forward (gmm: 1.18-1.22x the permuted
# path) but the gathered tgmm made forward+backward 1.07-1.19x slower than permute + plain kernels.
# CPU keeps the in-kernel path, so the interpret-mode tests exercise it.
TGMM_GATHER_IN_KERNEL = {"cpu": True, "cuda": False, "rocm": False}


def default_implementation(op: str) -> str:
    """The backend `implementation=None` asks for: the fastest measured one for this platform, or
    the one named by XMOE_KERNELS (e.g. the memory planner compiles the Pallas kernels on CPU so
    that no dense ragged_dot lowering inflates its temporaries), for every op or, given as
    op=backend pairs (XMOE_KERNELS=tgmm=ws), for the ops it names."""
    forced = os.environ.get("XMOE_KERNELS")
    if forced and "=" not in forced:
        return forced
    if forced:  # op=backend pairs, e.g. tgmm=ws,gmm=pallas: the others keep the table's choice
        pairs = dict(pair.split("=", 1) for pair in forced.split(",") if "=" in pair)
        if len(pairs) != len([p for p in forced.split(",") if p]):
            raise ValueError(
                f"XMOE_KERNELS={forced!r}: give one backend (pallas) or op=backend pairs (tgmm=ws,gmm=pallas)"
            )
        if op in pairs:
            return pairs[op]
    table = DEFAULT_IMPLEMENTATION.get(platform(), {})
    name = table.get(op) or table.get(op.removesuffix("_indexed"), "xla")
    if name == "ws" and not is_hopper():  # before Hopper, or a CUDA target traced on a CPU host: no warning
        return "pallas"
    return name


def default_tile(implementation: str, op: str = "gmm") -> tuple[int, int, int]:
    return DEFAULT_TILES.get((implementation, platform()), _CUDA_TILES)[op]


def fp8_weights_kmajor() -> bool:
    return FP8_WEIGHTS_KMAJOR.get(platform(), False)


_FUSED_BASE = {"gmm_act": "gmm", "gmm_act_grad": "gmm", "tgmm_act": "tgmm"}


def launch_params(implementation: str, op: str, tile, itemsize: int) -> tuple[int | None, int | None]:
    """(num_warps, num_stages), with stages cut until the pipelined tiles fit in shared memory.
    gmm/fused.py's ops take gmm's or tgmm's parameters; "gmm_act" and "tgmm_act" load two lhs tiles
    (gate and up) per step."""
    base = _FUSED_BASE.get(op, op)
    num_warps, num_stages = LAUNCH.get((implementation, platform()), {}).get(base, (None, None))
    limit = SHARED_MEMORY_BYTES.get(platform())
    if num_stages is None or limit is None:
        return num_warps, num_stages
    bm, bk, bn = tile
    lhs_tiles = 2 if op in ("gmm_act", "tgmm_act") else 1
    per_stage = (lhs_tiles * bm * bk + (bm * bn if base == "tgmm" else bk * bn)) * itemsize
    while num_stages > 1 and num_stages * per_stage > limit:
        num_stages -= 1
    return num_warps, num_stages


# gmm with lhs row indices and a grouped output (the one-GPU up-projection, the down-projection's d act):
# the Pallas kernel gathers on load (True), or XLA gathers the rows first and the plain kernel runs (on
# CUDA: ws, which has no gather). One H200, Small x 4 layers on one GPU (benchmarks/train_step.md,
# 2026-11-29): XLA's gather + ws ran the step 1.3-1.8% faster, but only because XLA keeps the forward's
# gathered rows for the backward's tgmm (7.9 GiB more at peak, 17%); gathered again in the backward, it
# gained 0.4% (noise). The kernel's gather stays the default; XMOE_GMM_GATHER=xla trades memory for speed.
GMM_GATHER_IN_KERNEL = {"cpu": True, "cuda": True, "rocm": True}


def _gathers_in_kernel(env: str, table: dict) -> bool:
    forced = os.environ.get(env)
    if forced not in (None, "", "kernel", "xla"):
        raise ValueError(f"{env}={forced!r}: use kernel or xla (or unset it for the measured default)")
    if forced:
        return forced == "kernel"
    return table.get(platform(), True)


def tgmm_gathers_in_kernel() -> bool:
    """Whether tgmm reads indexed rows inside its kernel (else XLA gathers them first: see above).
    XMOE_TGMM_GATHER=kernel or =xla overrides the table, for measuring the other one (the XLA gather
    grows with the receive buffer: benchmarks/exchange.md; scripts/gpu_bench_push.sh part depth_tgmm)."""
    return _gathers_in_kernel("XMOE_TGMM_GATHER", TGMM_GATHER_IN_KERNEL)


def gmm_gathers_in_kernel() -> bool:
    """Whether a gmm whose lhs rows are indexed (and output grouped) gathers them inside its kernel, or
    XLA gathers them first so that the call runs on the platform's plain kernel (GMM_GATHER_IN_KERNEL).
    XMOE_GMM_GATHER=kernel or =xla overrides the table."""
    return _gathers_in_kernel("XMOE_GMM_GATHER", GMM_GATHER_IN_KERNEL)


# Which of gmm/fused.py's ops run the activation inside the Pallas GEMM, per XMOE_FUSED_ACT mode.
# Measured slower both ways, so the default fuses none (benchmarks/fused.md, 2026-11-28):
# - one H200, Small x 4 layers on one GPU: the down-projection with the activation in its load ran
#   the step 4-5% slower than XLA's element-wise activation beside the plain kernel (each of the
#   D / block_n column tiles recomputes the activation of its rows, and loads two lhs tiles);
# - 4x H200, Small at 28 layers, EP 4, push: the d hidden epilogue alone ("grad") 5.2% slower, every
#   op fused ("kernel") 11.3% slower, than none, although XLA's passes run over the whole buffer.
FUSED_ACTIVATION = {
    "kernel": frozenset({"gmm_act", "gmm_act_grad", "tgmm_act"}),
    "grad": frozenset({"gmm_act_grad"}),
    "xla": frozenset(),
}
FUSED_ACTIVATION_DEFAULT = "xla"


def activation_in_kernel(op: str) -> bool:
    """Whether gmm/fused.py's `op` runs the activation inside its Pallas GEMM or as XLA element-wise
    ops beside a plain one. XMOE_FUSED_ACT=kernel|grad|xla overrides the default mode, for measuring
    one against another (the kernels are not wired into the MoE layer: benchmarks/fused.md)."""
    mode = os.environ.get("XMOE_FUSED_ACT") or FUSED_ACTIVATION_DEFAULT
    if mode not in FUSED_ACTIVATION:
        raise ValueError(
            f"XMOE_FUSED_ACT={mode!r}: use one of {tuple(FUSED_ACTIVATION)} (or unset it for the default, "
            f"{FUSED_ACTIVATION_DEFAULT})"
        )
    return op in FUSED_ACTIVATION[mode]
