"""Causal attention backends behind one call: `attend(q, k, v, implementation)`.

Shapes: B batch, S sequence, H query heads, G key/value heads (GQA: H % G == 0),
K query/key head dim, U value head dim. Inputs [B,S,H,K] / [B,S,G,K] / [B,S,G,U], output
[B,S,H,U] in q's dtype. U < K (multi-head latent attention: K = 192, U = 128 in DeepSeek's
models): every backend gets the values padded with zeros to K dims (jax's attention and the
Pallas kernel take one head dim; the padded output dims are zeros, cut off after), so the
AV product costs K/U times its FLOPs; the softmax scale is the caller's (`scale`).

| backend | what                                                     | runs on           |
|---------|----------------------------------------------------------|-------------------|
| xla     | `jax.nn.dot_product_attention` (XLA): the reference      | everywhere        |
| cudnn   | the same call with `implementation="cudnn"`: flash attention in cuDNN | NVIDIA |
| pallas  | JAX's Triton-style Pallas flash attention (`pallas.ops.gpu.attention.mha`, its own VJP); lowers through Triton on CUDA and ROCm, interpret mode on CPU | GPU (CPU: tests) |

`auto` takes cuDNN on NVIDIA where its shape rules hold (bf16/fp16, K a multiple of
8 and at most 128, or 256 on Hopper and later), the Pallas kernel (which pads K to a power of two itself) on ROCm where its rules hold (S a multiple of
its blocks), and XLA everywhere else. A backend asked for by name that cannot take
the call falls back to XLA with one warning per reason, never an error mid-run.
Measured on one H100 (docs/design.md#attention): forward+backward for B=8, S=2048,
16 heads of 128, XLA 9.32 ms, cuDNN 1.63 ms. The Pallas kernel has no GQA: the key and
value heads are repeated to H first (memory, not FLOPs).
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp

from xmoe_jax import sharding
from xmoe_jax.kernels import shapes
from xmoe_jax.kernels.platform import platform

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas")
PALLAS_BLOCK = 128  # the kernel's default q/k block: S must be a multiple of min(S, 128)
PALLAS_WIDE_BLOCK = 64  # head dims padded past 128 (MLA's 192 -> 256): 128-row blocks overflow shared memory


def _cudnn_reason(q, k) -> str | None:
    if platform() != "cuda":
        return f"cuDNN attention needs an NVIDIA GPU, platform is {platform()}"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN flash attention takes bf16/fp16, got {q.dtype}"
    head_dim, limit = q.shape[-1], _cudnn_max_head_dim()
    if head_dim % 8 or head_dim > limit:
        return f"cuDNN flash attention needs head_dim a multiple of 8 and <= {limit} here, got {head_dim}"
    return None


def _cudnn_max_head_dim() -> int:
    """cuDNN's flash attention takes head dims up to 256 on Hopper (compute capability 9) and later."""
    capability = str(getattr(jax.devices()[0], "compute_capability", "0"))
    return 256 if int(capability.split(".")[0]) >= 9 else 128


@functools.cache
def pallas_attention_module():
    """jax.experimental.pallas.ops.gpu.attention (JAX's Triton-style flash attention), or None where this
    jax no longer ships it (removed in jax 0.12.1)."""
    try:
        from jax.experimental.pallas.ops.gpu import attention
    except ImportError:
        return None
    return attention


def _pallas_reason(q, k) -> str | None:
    if platform() not in ("cpu", "cuda", "rocm"):
        return f"no Pallas Triton lowering on {platform()}"
    if pallas_attention_module() is None:
        return f"jax {jax.__version__} no longer ships jax.experimental.pallas.ops.gpu.attention (removed in 0.12.1)"
    seq = q.shape[1]
    if seq % min(seq, PALLAS_BLOCK):
        return f"Pallas flash attention needs the sequence ({seq}) a multiple of {PALLAS_BLOCK}"
    if q.shape[-1] != k.shape[-1]:
        return "Pallas flash attention needs equal q and k head dims"
    return None


_REASONS = {"xla": lambda q, k: None, "cudnn": _cudnn_reason, "pallas": _pallas_reason}


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def choose(implementation: str, q, k) -> str:
    """The backend that will run: `auto`'s pick, or the requested one unless it cannot (then xla)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if shapes.enabled():  # memory planning: a flash-attention-sized stand-in (kernels/shapes.py)
        return "shapes"
    if implementation == "auto":
        preferred = {"cuda": "cudnn", "rocm": "pallas"}.get(platform(), "xla")
        return preferred if _REASONS[preferred](q, k) is None else "xla"
    reason = _REASONS[implementation](q, k)
    if reason is not None:
        _warn_once(f"attention: {implementation!r} unavailable ({reason}); using 'xla'")
        return "xla"
    return implementation


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _pallas(q_BSHK, k_BSGK, v_BSGK, scale=None):
    pallas_attention = pallas_attention_module()
    groups = q_BSHK.shape[2] // k_BSGK.shape[2]
    if groups > 1:  # the kernel indexes k/v by query head
        k_BSGK, v_BSGK = (jnp.repeat(a, groups, axis=2) for a in (k_BSGK, v_BSGK))
    seq = q_BSHK.shape[1]
    wide = _next_power_of_2(q_BSHK.shape[-1]) > 128  # the kernel pads the head dim to a power of 2
    block = min(seq, PALLAS_WIDE_BLOCK if wide else PALLAS_BLOCK)
    sizes = pallas_attention.BlockSizes(
        block_q=block, block_k=block, block_q_dkv=min(block, 32), block_kv_dkv=min(block, 32),
        block_q_dq=min(block, 32), block_kv_dq=min(block, 32),
    )  # fmt: skip
    return pallas_attention.mha(
        q_BSHK,
        k_BSGK,
        v_BSGK,
        None,
        sm_scale=1.0 / math.sqrt(q_BSHK.shape[-1]) if scale is None else scale,
        causal=True,
        block_sizes=sizes,
        interpret=platform() == "cpu",
    )


def _per_shard(fn, shard_names, q_BSHK, k_BSGK, v_BSGK):
    """`fn` per device over the batch and head shards (XLA cannot partition a Pallas kernel)."""
    mesh = sharding.current_mesh()
    if mesh is None or shard_names is None:
        return fn(q_BSHK, k_BSGK, v_BSGK)
    q_names, kv_names = shard_names
    rules = sharding.ACTIVATION_RULES
    q_spec = sharding.named_sharding(mesh, q_names, q_BSHK.shape, rules).spec
    kv_spec = sharding.named_sharding(mesh, kv_names, k_BSGK.shape, rules).spec
    if tuple(q_spec)[2:3] != tuple(kv_spec)[2:3]:  # kv heads not split like q heads: keep them whole
        q_spec = jax.sharding.PartitionSpec(*tuple(q_spec)[:2])
        kv_spec = q_spec
    return jax.shard_map(
        fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec, check_vma=False
    )(q_BSHK, k_BSGK, v_BSGK)


@jax.custom_vjp
def _shapes(q_BSHK, k_BSGK, v_BSGK):
    return shapes.opaque(jax.ShapeDtypeStruct(q_BSHK.shape, q_BSHK.dtype), q_BSHK, k_BSGK, v_BSGK)


def _shapes_fwd(q_BSHK, k_BSGK, v_BSGK):
    o_BSHK = _shapes(q_BSHK, k_BSGK, v_BSGK)
    b, s, h, _ = q_BSHK.shape
    lse_BHS = shapes.opaque(jax.ShapeDtypeStruct((b, h, s), jnp.float32), q_BSHK)  # flash keeps it
    return o_BSHK, (q_BSHK, k_BSGK, v_BSGK, o_BSHK, lse_BHS)


def _shapes_bwd(res, g_BSHK):
    grads = [shapes.opaque(jax.ShapeDtypeStruct(a.shape, a.dtype), *res, g_BSHK) for a in res[:3]]
    return tuple(grads)


_shapes.defvjp(_shapes_fwd, _shapes_bwd)


def attend(
    q_BSHK: jax.Array,
    k_BSGK: jax.Array,
    v_BSGK: jax.Array,
    implementation: str = "auto",
    shard_names: tuple | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Causal softmax attention, scale `scale` (None: 1/sqrt(K)), by the chosen backend.

    `shard_names`: the logical names of q and of k/v, so the Pallas kernel runs per
    device on the ambient mesh (cuDNN and XLA are partitioned by XLA itself). Values with
    fewer dims than the keys are padded to them and the output cut back (module docstring).
    """
    v_dim, k_dim = v_BSGK.shape[-1], k_BSGK.shape[-1]
    if v_dim < k_dim:
        v_BSGK = jnp.pad(v_BSGK, [(0, 0)] * 3 + [(0, k_dim - v_dim)])
    impl = choose(implementation, q_BSHK, k_BSGK)
    if impl == "pallas":
        o_BSHK = _per_shard(functools.partial(_pallas, scale=scale), shard_names, q_BSHK, k_BSGK, v_BSGK)
    elif impl == "shapes":  # the stand-in has only shapes: the scale changes nothing it models
        o_BSHK = _per_shard(_shapes, shard_names, q_BSHK, k_BSGK, v_BSGK)
    else:
        o_BSHK = jax.nn.dot_product_attention(
            q_BSHK,
            k_BSGK,
            v_BSGK,
            scale=scale,
            is_causal=True,
            implementation="cudnn" if impl == "cudnn" else None,
        )
    return o_BSHK[..., :v_dim] if v_dim < k_dim else o_BSHK
