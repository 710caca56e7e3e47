"""Varying-manual-axes alignment for custom VJPs used inside `shard_map`.

Inside shard_map every value carries the set of mesh axes it varies over. A weight
replicated over `data` but used with tokens split over `data` gets a gradient that
varies over `data`; plain autodiff inserts the psum, but a custom VJP must return a
cotangent of the primal's exact type. Casting all operands to the union of their
varying axes before the custom VJP makes the cast's own transpose do that psum.
Outside shard_map (or on JAX versions without the notion) this is the identity.
"""

from __future__ import annotations

import jax


def _vma(x) -> frozenset:
    """Mesh axes x varies over: `aval.mat.varying` (jax >= 0.10) or `aval.vma` (older)."""
    try:
        aval = jax.typeof(x)
    except Exception:
        return frozenset()
    mat = getattr(aval, "mat", None)
    varying = getattr(mat, "varying", None) if mat is not None else None
    if varying is None:
        varying = getattr(aval, "vma", None)
    return frozenset(varying or ())


def _to_varying(x, axes: tuple[str, ...]):
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)


def match_vma(*arrays):
    """The arrays, each made varying over the union of all their varying mesh axes."""
    vmas = [_vma(a) for a in arrays]
    union = frozenset().union(*vmas)
    if not union:
        return arrays
    return tuple(
        a if a is None or v == union else _to_varying(a, tuple(sorted(union - v)))
        for a, v in zip(arrays, vmas, strict=True)
    )
