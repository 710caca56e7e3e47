"""The backend registry: the one table that maps a backend name to code, and the choice per call.

Backends (`implementation=`), one object each in IMPLEMENTATIONS:
  "xla"     jax.lax.ragged_dot / ragged_dot_general / gathers: the oracle, runs everywhere.
  "pallas"  Triton-style Pallas kernels: Triton lowering on CUDA and ROCm, interpret mode on CPU.
  "triton"  the same GEMM algorithm as a Triton kernel called through jax-triton (CUDA, ROCm).
  "mgpu"    JAX's bundled Mosaic-GPU ragged dots (Hopper, NVIDIA only).
  "ws"      our warp-specialized Mosaic-GPU grouped GEMMs (gmm/mgpu_ws.py, gmm/mgpu_ws_tgmm.py; Hopper):
            contiguous gmm and tgmm only; permute / FP8 / row-indexed calls run on its fallback, pallas.
FP8 (op "gmm_fp8", called by xmoe_jax/fp8/gmm.py): xla (gmm/xla.py, the dequantizing float32
oracle) and pallas (gmm/pallas_fp8.py) run it; triton and mgpu say why they cannot and hand it on.
  "shapes"  shape-only stand-ins for compile-time memory planning (kernels/shapes.py), never numbers.

A backend says why it cannot run on this machine at all (`unavailable_reason`: platform,
missing package) and why it cannot take one call (`shape_reason`: shapes, dtypes, tile), and
runs the ops it has kernels for (`ops`): "gmm", "tgmm", "gmm_fp8", "permute" (permute, combine and
their gather-dot) and "act_grad" (the activation's backward with the routing weight, act_grad/api.py). Row-indexed gmm / tgmm calls (gmm/api.py; `Call.indexed`) run on xla, pallas and
triton; mgpu refuses them (no TMA gather on Hopper) and hands them to pallas. `choose_backend` starts from the requested backend, or the platform's
default (defaults.py), and walks `fallback` (mgpu -> pallas -> xla, triton -> pallas -> xla)
past every backend that cannot run the call, with one warning per distinct reason, so a call
never fails for lack of a kernel. A backend with no kernel of its own for an op (triton and
mgpu for permute) hands it to its fallback without a warning. The choice is made at trace
time from static facts only: a jitted function never compiles a kernel that cannot run.
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp

from xmoe_jax.kernels import defaults, shapes
from xmoe_jax.kernels.act_grad import pallas as act_grad_pallas
from xmoe_jax.kernels.act_grad import xla as act_grad_xla
from xmoe_jax.kernels.gmm import mgpu as gmm_mgpu
from xmoe_jax.kernels.gmm import mgpu_ws as gmm_ws
from xmoe_jax.kernels.gmm import mgpu_ws_tgmm as ws_tgmm
from xmoe_jax.kernels.gmm import pallas as gmm_pallas
from xmoe_jax.kernels.gmm import pallas_fp8 as gmm_pallas_fp8
from xmoe_jax.kernels.gmm import triton as gmm_triton  # jax-triton itself is imported on first call
from xmoe_jax.kernels.gmm import xla as gmm_xla
from xmoe_jax.kernels.gmm.fp8_call import Fp8Gmm
from xmoe_jax.kernels.permute import pallas as permute_pallas
from xmoe_jax.kernels.permute import xla as permute_xla
from xmoe_jax.kernels.platform import has_module, interpret, is_hopper, platform
from xmoe_jax.kernels.validation import check_tile

_MAX_I32 = 2**31 - 1


class Call(NamedTuple):
    """The static facts of one kernel call that a backend may refuse."""

    op: str  # "gmm", "tgmm", "gmm_fp8", "permute" or "act_grad"
    arrays: tuple  # operands and result (anything with .size and .dtype); arrays[0]'s dtype is the input's
    k_dim: int = 0  # gmm / tgmm: contraction K and output columns N
    n_dim: int = 0
    tile: tuple[int, int, int] | None = None  # the requested tile; None = the backend's default
    block_k: int = 0  # gmm_fp8: K-block length of the scales (0: one scale along K)
    indexed: bool = False  # gmm / tgmm: rows gathered or scattered through index arrays (gmm/api.py)


class Backend:
    """One way to run the kernels; a subclass overrides the ops it has kernels for.

    Shapes follow the ops' legends: R rows, K contraction, N output columns, E experts for
    gmm / tgmm; T tokens, D model, K top-k for permute. `tile` is the caller's (None: defaults.py).
    """

    name: str = ""
    fallback: str | None = None  # the backend that takes a call this one cannot run
    ops: frozenset[str] = frozenset()  # ops with a kernel of its own

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend {self.name!r}>"

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run on this machine at all (platform, package), or None."""
        return None

    def shape_reason(self, call: Call) -> str | None:
        """Why it cannot take this call's shapes, dtypes or tile, or None."""
        return None

    def tile(self, op: str, tile) -> tuple[int, int, int]:
        """The requested tile, checked, or this platform's default for this backend and op."""
        return check_tile(defaults.default_tile(self.name, op) if tile is None else tile, power_of_two=True)

    def gmm(self, lhs_LK, rhs_EKN, group_sizes_E, *, out_dtype, tile, transpose_rhs=False, **rows):
        """[R, N] grouped product (rhs [E, N, K] with transpose_rhs); [O, N] when scattered.
        `rows`: lhs_rows_R, out_rows_R, num_out_rows, zero_unwritten (gmm/api.py)."""
        raise NotImplementedError(f"{self.name} has no gmm kernel")

    def tgmm(self, lhs_LK, grad_GN, group_sizes_E, *, out_dtype, tile, lhs_rows_R=None, grad_rows_R=None):
        """[E, K, N] per-group lhs.T @ grad, rows through the optional indices; see gmm/api.py."""
        raise NotImplementedError(f"{self.name} has no tgmm kernel")

    def gmm_fp8(self, call: Fp8Gmm, *, tile):
        """[R, N] scaled FP8 grouped product ([O, N] scattered); the call as gmm/fp8_call.py says."""
        raise NotImplementedError(f"{self.name} has no gmm_fp8 kernel")

    def permute(self, x_TD, dest_TK, weights_TK, num_rows):
        """[R, D]: out[dest[t,k]] = x[t] * weights[t,k] (weights None: 1); see permute/api.py."""
        raise NotImplementedError(f"{self.name} has no permute kernel")

    def combine(self, y_RD, dest_TK, weights_TK):
        """[T, D]: out[t] = sum_k weights[t,k] * y[dest[t,k]] (weights None: 1)."""
        raise NotImplementedError(f"{self.name} has no combine kernel")

    def gather_dot(self, a_TD, b_RD, dest_TK):
        """float32 [T, K]: out[t,k] = a[t] . b[dest[t,k]] (the weight gradients)."""
        raise NotImplementedError(f"{self.name} has no gather-dot kernel")

    def act_grad(self, gate_RF, up_RF, u_RF, g_R, activation):
        """(d gate or None, d up, act * g, s) of the activation's backward (act_grad/api.py)."""
        raise NotImplementedError(f"{self.name} has no act_grad kernel")


class Xla(Backend):
    """jax.lax ragged dots and gathers (gmm/xla.py, permute/xla.py): the oracle and last fallback."""

    name = "xla"
    ops = frozenset({"gmm", "tgmm", "gmm_fp8", "permute", "act_grad"})

    def gmm(
        self,
        lhs_LK,
        rhs_EKN,
        group_sizes_E,
        *,
        out_dtype,
        tile,
        transpose_rhs=False,
        zero_unwritten=False,
        **rows,
    ):
        del zero_unwritten  # the reference's unwritten rows are zeros anyway
        return gmm_xla.gmm_xla(
            lhs_LK, rhs_EKN, group_sizes_E, out_dtype=out_dtype, transpose_rhs=transpose_rhs, **rows
        )

    def tgmm(self, lhs_LK, grad_GN, group_sizes_E, *, out_dtype, tile, lhs_rows_R=None, grad_rows_R=None):
        return gmm_xla.tgmm_xla(
            lhs_LK,
            grad_GN,
            group_sizes_E,
            out_dtype=out_dtype,
            lhs_rows_R=lhs_rows_R,
            grad_rows_R=grad_rows_R,
        )

    def gmm_fp8(self, call, *, tile):
        return gmm_xla.gmm_fp8_xla(call)  # accumulates in float32 throughout: imprecise_acc unused

    def permute(self, x_TD, dest_TK, weights_TK, num_rows):
        return permute_xla.scatter_rows_xla(x_TD, dest_TK, weights_TK, num_rows)

    def combine(self, y_RD, dest_TK, weights_TK):
        return permute_xla.combine_rows_xla(y_RD, dest_TK, weights_TK)

    def gather_dot(self, a_TD, b_RD, dest_TK):
        return permute_xla.gather_dot_xla(a_TD, b_RD, dest_TK)

    def act_grad(self, gate_RF, up_RF, u_RF, g_R, activation):
        return act_grad_xla.act_grad_xla(gate_RF, up_RF, u_RF, g_R, activation)


class Pallas(Backend):
    """Triton-style Pallas kernels (gmm/pallas.py, permute/pallas.py); interpret mode off-GPU."""

    name, fallback = "pallas", "xla"
    ops = frozenset({"gmm", "tgmm", "gmm_fp8", "permute", "act_grad"})
    gmm_kernel, tgmm_kernel = staticmethod(gmm_pallas.gmm_pallas), staticmethod(gmm_pallas.tgmm_pallas)

    def unavailable_reason(self):
        plat = platform()
        return None if plat in ("cpu", "cuda", "rocm") else f"no Pallas Triton lowering on {plat}"

    def shape_reason(self, call):
        if any(a.size > _MAX_I32 for a in call.arrays):
            return "an operand has 2^31 or more elements (Pallas Triton offsets are 32-bit)"
        if call.op == "gmm_fp8" and call.k_dim % self.tile("gmm_fp8", call.tile)[1]:
            return f"K={call.k_dim} is not a multiple of the FP8 kernel's block_k (masked fp8 loads have no fill)"
        if call.op == "gmm_fp8" and call.block_k and self.tile("gmm_fp8", call.tile)[1] != call.block_k:
            return f"blockwise FP8 scales need block_k = their K-block {call.block_k}, tile is {call.tile}"
        if call.op == "gmm_fp8" and platform() == "cuda" and not is_hopper():
            return "FP8 tensor-core dots need an NVIDIA Hopper (sm_90) or newer GPU"
        return None

    def launch(self, op: str, tile, dtype) -> dict:
        """The GEMM kernels' launch arguments: interpret mode, num_warps, num_stages (defaults.py)."""
        num_warps, num_stages = defaults.launch_params(self.name, op, tile, jnp.dtype(dtype).itemsize)
        return dict(interpret=interpret(), num_warps=num_warps, num_stages=num_stages)

    def gmm(self, lhs_LK, rhs_EKN, group_sizes_E, *, out_dtype, tile, transpose_rhs=False, **rows):
        tile = self.tile("gmm", tile)
        return self.gmm_kernel(
            lhs_LK, rhs_EKN, group_sizes_E, out_dtype=out_dtype, tile=tile, transpose_rhs=transpose_rhs,
            **rows, **self.launch("gmm", tile, lhs_LK.dtype),
        )  # fmt: skip

    def tgmm(self, lhs_LK, grad_GN, group_sizes_E, *, out_dtype, tile, lhs_rows_R=None, grad_rows_R=None):
        tile = self.tile("tgmm", tile)
        return self.tgmm_kernel(
            lhs_LK, grad_GN, group_sizes_E, out_dtype=out_dtype, tile=tile, lhs_rows_R=lhs_rows_R,
            grad_rows_R=grad_rows_R, **self.launch("tgmm", tile, lhs_LK.dtype),
        )  # fmt: skip

    def gmm_fp8(self, call, *, tile):
        # epilogue scales with float32 promotion along K have their own best tile (defaults.py)
        k_dim = call.lhs_q_LK.shape[1]
        op = "gmm_fp8_promoted" if not call.block_k and call.imprecise_acc < k_dim else "gmm_fp8"
        tile = self.tile(op, tile)
        kmajor = defaults.fp8_weights_kmajor()  # Hopper FP8 wgmma reads K-major weights
        rhs_q = jnp.swapaxes(call.rhs_q_EKN, 1, 2) if kmajor else call.rhs_q_EKN
        return gmm_pallas_fp8.gmm_fp8_pallas(
            call.lhs_q_LK, call.lhs_s_LB, rhs_q, call.rhs_s_EBN, call.group_sizes_E, out_dtype=call.out_dtype,
            tile=tile, transpose_rhs=kmajor, imprecise_acc=call.imprecise_acc, **call.rows,
            **self.launch(op, tile, call.lhs_q_LK.dtype),
        )  # fmt: skip

    def permute(self, x_TD, dest_TK, weights_TK, num_rows):
        scale_TK = jnp.ones(dest_TK.shape, jnp.float32) if weights_TK is None else weights_TK
        blocks = permute_pallas.BLOCKS["scatter_rows"]
        return permute_pallas.scatter_rows_pallas(
            x_TD, dest_TK, scale_TK, num_rows, interpret=interpret(), **blocks
        )

    def combine(self, y_RD, dest_TK, weights_TK):
        blocks = permute_pallas.BLOCKS["combine_rows"]
        return permute_pallas.combine_rows_pallas(y_RD, dest_TK, weights_TK, interpret=interpret(), **blocks)

    def gather_dot(self, a_TD, b_RD, dest_TK):
        blocks = permute_pallas.BLOCKS["gather_dot"]
        return permute_pallas.gather_dot_pallas(a_TD, b_RD, dest_TK, interpret=interpret(), **blocks)

    def act_grad(self, gate_RF, up_RF, u_RF, g_R, activation):
        return act_grad_pallas.act_grad_pallas(
            gate_RF, up_RF, u_RF, g_R, activation, interpret=interpret(), **act_grad_pallas.BLOCKS
        )


class Triton(Pallas):
    """Pallas's GEMM algorithm written in Triton (gmm/triton.py), run through jax-triton on a GPU.

    It shares Pallas's gmm / tgmm methods with its own kernels and launch arguments; it has no
    permute kernels (`ops`), so permute runs on its fallback, pallas.
    """

    name, fallback = "triton", "pallas"
    ops = frozenset({"gmm", "tgmm", "gmm_fp8"})  # gmm_fp8: listed so that shape_reason says why not
    gmm_kernel, tgmm_kernel = staticmethod(gmm_triton.gmm_triton), staticmethod(gmm_triton.tgmm_triton)

    def unavailable_reason(self):
        plat = platform()
        if plat not in ("cuda", "rocm"):
            return f"jax-triton needs a GPU, platform is {plat}"
        if not (has_module("jax_triton") and has_module("triton")):
            return "jax-triton is not installed (pip install 'xmoe_jax[triton]')"
        return None

    def shape_reason(self, call):
        if call.op == "gmm_fp8":
            return "gmm/triton.py has no FP8 kernel (the Pallas backend has one)"
        return None  # 64-bit row offsets: no 2^31-element limit

    def launch(self, op: str, tile, dtype) -> dict:
        num_warps, num_stages = defaults.launch_params(self.name, op, tile, jnp.dtype(dtype).itemsize)
        return dict(num_warps=num_warps or 8, num_stages=num_stages or 3)


class Mosaic(Backend):
    """JAX's Mosaic-GPU ragged dots (gmm/mgpu.py), Hopper only; permute runs on pallas."""

    name, fallback = "mgpu", "pallas"
    ops = frozenset({"gmm", "tgmm", "gmm_fp8"})  # gmm_fp8: listed so that shape_reason says why not

    def unavailable_reason(self):
        if not is_hopper():
            return "Mosaic GPU ragged dot needs an NVIDIA Hopper GPU"
        if not has_module("jax.experimental.pallas.ops.gpu.ragged_dot_mgpu"):
            return "jax.experimental.pallas.ops.gpu.ragged_dot_mgpu is not in this jax"
        return None

    def shape_reason(self, call):
        if call.op == "gmm_fp8":
            return "JAX's Mosaic ragged dot takes bf16/f16 operands only (no FP8 scales)"
        if call.indexed:
            return "JAX's Mosaic ragged dot has no row indices (Hopper has no TMA gather; gmm/mgpu.py)"
        tile = self.tile(call.op, call.tile)
        return gmm_mgpu.shape_reason(call.op, call.arrays[0].dtype, call.k_dim, call.n_dim, tile)

    def gmm(
        self,
        lhs_LK,
        rhs_EKN,
        group_sizes_E,
        *,
        out_dtype,
        tile,
        transpose_rhs=False,
        zero_unwritten=False,
        **rows,
    ):
        del rows  # shape_reason refused indexed calls
        return gmm_mgpu.gmm_mgpu(
            lhs_LK, rhs_EKN, group_sizes_E, out_dtype=out_dtype, tile=self.tile("gmm", tile),
            transpose_rhs=transpose_rhs, zero_unwritten=zero_unwritten,
        )  # fmt: skip

    def tgmm(self, lhs_LK, grad_GN, group_sizes_E, *, out_dtype, tile, lhs_rows_R=None, grad_rows_R=None):
        tile = self.tile("tgmm", tile)
        return gmm_mgpu.tgmm_mgpu(lhs_LK, grad_GN, group_sizes_E, out_dtype=out_dtype, tile=tile)


class WarpSpecialized(Backend):
    """Our warp-specialized Mosaic-GPU grouped GEMMs (gmm/mgpu_ws.py, mgpu_ws_tgmm.py), Hopper only,
    contiguous rows only.

    Its configs are its own (defaults.WS_CONFIGS, picked by the output columns), not a Pallas tile:
    a call that names a tile goes to pallas. Row-indexed calls (no TMA gather on Hopper) are not
    offered to it: the defaults route them to pallas (`gmm_indexed`), and asked for by name they
    fall back with a warning."""

    name, fallback = "ws", "pallas"
    ops = frozenset({"gmm", "tgmm"})

    def unavailable_reason(self):
        if platform() != "cuda" or not is_hopper():
            return "the warp-specialized Mosaic GEMM needs an NVIDIA Hopper GPU"
        return None

    def shape_reason(self, call):
        if call.indexed:
            return "it has no row indices (Hopper has no TMA gather): pallas gathers on load"
        if call.tile is not None:
            return f"it takes its own configs (defaults.WS_CONFIGS), not a tile {call.tile}"
        lhs = call.arrays[0]
        if call.op == "tgmm":
            config = defaults.ws_tgmm_config(call.k_dim, call.n_dim)
            out = call.arrays[-1]
            return ws_tgmm.shape_reason(lhs.dtype, call.k_dim, call.n_dim, lhs.shape[0], config, out.dtype)
        config = defaults.ws_config(call.n_dim)
        return gmm_ws.shape_reason(lhs.dtype, call.k_dim, call.n_dim, config, lhs.shape[0])

    def gmm(self, lhs_LK, rhs_EKN, group_sizes_E, *, out_dtype, tile, transpose_rhs=False, zero_unwritten=False, **rows):  # fmt: skip
        del tile, rows  # shape_reason refused tiles and indexed calls
        n_dim = rhs_EKN.shape[1] if transpose_rhs else rhs_EKN.shape[2]
        out = gmm_ws.gmm_ws(
            lhs_LK, rhs_EKN, group_sizes_E, out_dtype=out_dtype, config=defaults.ws_config(n_dim),
            transpose_rhs=transpose_rhs,
        )  # fmt: skip
        return gmm_mgpu.zero_tail(out, group_sizes_E) if zero_unwritten else out

    def tgmm(self, lhs_LK, grad_GN, group_sizes_E, *, out_dtype, tile, lhs_rows_R=None, grad_rows_R=None):
        del tile, lhs_rows_R, grad_rows_R  # shape_reason refused tiles and indexed calls
        config = defaults.ws_tgmm_config(lhs_LK.shape[1], grad_GN.shape[1])
        return ws_tgmm.tgmm_ws(lhs_LK, grad_GN, group_sizes_E, out_dtype=out_dtype, config=config)


class Shapes(Backend):
    """Shape-only stand-ins (shapes.py): for compile-time memory planning on CPU, never for numbers."""

    name, fallback = "shapes", "xla"
    ops = frozenset({"gmm", "tgmm", "permute", "act_grad"})

    def unavailable_reason(self) -> str | None:
        return None if shapes.enabled() else "a memory-planning stand-in, on only with XMOE_KERNELS=shapes"

    def gmm(
        self, lhs_LK, rhs_EKN, group_sizes_E, *, out_dtype, tile, transpose_rhs=False, lhs_rows_R=None,
        out_rows_R=None, num_out_rows=None, zero_unwritten=False,
    ):  # fmt: skip
        n_dim = rhs_EKN.shape[1] if transpose_rhs else rhs_EKN.shape[2]
        num_rows = lhs_LK.shape[0] if lhs_rows_R is None else lhs_rows_R.shape[0]
        out = jax.ShapeDtypeStruct((num_rows if out_rows_R is None else num_out_rows, n_dim), out_dtype)
        index = tuple(a for a in (lhs_rows_R, out_rows_R) if a is not None)
        return shapes.opaque(out, lhs_LK, rhs_EKN, group_sizes_E, *index)

    def tgmm(self, lhs_LK, grad_GN, group_sizes_E, *, out_dtype, tile, lhs_rows_R=None, grad_rows_R=None):
        out = jax.ShapeDtypeStruct((group_sizes_E.shape[0], lhs_LK.shape[1], grad_GN.shape[1]), out_dtype)
        index = tuple(a for a in (lhs_rows_R, grad_rows_R) if a is not None)
        return shapes.opaque(out, lhs_LK, grad_GN, group_sizes_E, *index)

    def permute(self, x_TD, dest_TK, weights_TK, num_rows):
        extra = () if weights_TK is None else (weights_TK,)
        return shapes.opaque(
            jax.ShapeDtypeStruct((num_rows, x_TD.shape[1]), x_TD.dtype), x_TD, dest_TK, *extra
        )

    def combine(self, y_RD, dest_TK, weights_TK):
        extra = () if weights_TK is None else (weights_TK,)
        return shapes.opaque(
            jax.ShapeDtypeStruct((dest_TK.shape[0], y_RD.shape[1]), y_RD.dtype), y_RD, dest_TK, *extra
        )

    def gather_dot(self, a_TD, b_RD, dest_TK):
        return shapes.opaque(jax.ShapeDtypeStruct(dest_TK.shape, jnp.float32), a_TD, b_RD, dest_TK)

    def act_grad(self, gate_RF, up_RF, u_RF, g_R, activation):
        rows = jax.ShapeDtypeStruct(up_RF.shape, up_RF.dtype)
        ins = tuple(a for a in (gate_RF, up_RF, u_RF, g_R) if a is not None)
        return (
            None if gate_RF is None else shapes.opaque(rows, *ins),
            shapes.opaque(rows, *ins),
            shapes.opaque(rows, *ins),
            shapes.opaque(jax.ShapeDtypeStruct(g_R.shape, jnp.float32), *ins),
        )


IMPLEMENTATIONS: dict[str, Backend] = {
    b.name: b for b in (Xla(), Pallas(), Triton(), Mosaic(), WarpSpecialized(), Shapes())
}


def check_name(implementation: str | None) -> None:
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {tuple(IMPLEMENTATIONS)} or None, got {implementation!r}"
        )


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=4)


def reset_warnings() -> None:
    """Let every fallback warn again (scripts that report which backend actually ran)."""
    _warn_once.cache_clear()


def choose_backend(implementation: str | None, call: Call) -> Backend:
    """The backend that runs `call`: the requested one (None: the platform's default for the op),
    or the first one along its fallback chain that can run here and take the call."""
    check_name(implementation)
    op = f"{call.op}_indexed" if call.indexed else call.op  # the defaults may differ for indexed calls
    name = defaults.default_implementation(op) if implementation is None else implementation
    check_name(name)  # XMOE_KERNELS may name one that does not exist
    while True:
        backend = IMPLEMENTATIONS[name]
        if call.op not in backend.ops:  # no kernel of its own for this op: its fallback's, silently
            name = backend.fallback
            continue
        reason = backend.unavailable_reason() or backend.shape_reason(call)
        if reason is None:
            return backend
        _warn_once(f"{call.op}: implementation {name!r} unavailable ({reason}); using {backend.fallback!r}")
        name = backend.fallback
