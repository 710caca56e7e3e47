"""Kernels (xmoe_jax.kernels): one suite run against every backend this machine has.

On CPU that is "xla" (the oracle) and "pallas" in interpret mode; on a GPU also "triton" and
"mgpu" when they can run. References are float64 NumPy loops written from the definitions;
gradients are checked against jax.grad of an independent jnp formulation (einsum with a
one-hot group mask / a dense permutation matrix). Inputs are fresh random draws per example,
never zeros. Shapes are tiny and tiles 16 so interpret mode stays fast: K and N are not
multiples of the tile, and group sizes come from hypothesis (empty groups, one group holding
every row, sizes that are not tile multiples, sum(group_sizes) < R).

A second suite (test_backend_matches_float64_reference_at_default_tiles, the former
scripts/check_kernels_gpu.py) runs every backend at its default tiles on realistic shapes; its
"gpu" scale is marked `gpu` and runs only on a GPU: `python -m pytest -m gpu tests/test_kernels.py`.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from xmoe_jax.kernels import IMPLEMENTATIONS, combine, default_implementation, defaults, gmm, permute, tgmm
from xmoe_jax.kernels.platform import platform

R, K, N, E = 56, 40, 24, 4  # rows, contraction, columns, groups: R, K, N not multiples of TILE
TILE = (16, 16, 16)
T, TOP_K, D = 12, 3, 40  # tokens, top-k, model dim for permute/combine
SETTINGS = settings(max_examples=6, deadline=None)


def _unavailable(impl: str) -> str | None:
    return IMPLEMENTATIONS[impl].unavailable_reason()


def _available(impl: str) -> bool:
    return _unavailable(impl) is None


BACKENDS = [
    pytest.param(
        impl,
        marks=pytest.mark.skipif(not _available(impl), reason=f"{impl}: {_unavailable(impl)}"),
    )
    for impl in IMPLEMENTATIONS
    if impl != "shapes"  # the planner's shape-only stand-in computes nothing (kernels/shapes.py)
]
PERMUTE_BACKENDS = ["xla", "pallas"]  # "triton"/"mgpu" run the pallas permute kernels


# ---------------------------------------------------------------- references (float64 NumPy)


def f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), dtype=np.float64)


def rel_err(got, want) -> float:
    got, want = f64(got), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "non-finite output"
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def group_rows(group_sizes) -> list[slice]:
    ends = np.cumsum(group_sizes)
    return [slice(int(e - s), int(e)) for s, e in zip(group_sizes, ends, strict=True)]


def gmm_ref(lhs, rhs, group_sizes) -> np.ndarray:
    lhs, rhs = f64(lhs), f64(rhs)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    for e, rows in enumerate(group_rows(group_sizes)):
        out[rows] = lhs[rows] @ rhs[e]
    return out


def tgmm_ref(lhs, grad, group_sizes) -> np.ndarray:
    lhs, grad = f64(lhs), f64(grad)
    return np.stack([lhs[rows].T @ grad[rows] for rows in group_rows(group_sizes)])


def permute_ref(x, dest, num_rows, weights=None) -> np.ndarray:
    x, dest = f64(x), np.asarray(dest).reshape(-1)
    w = np.ones(dest.shape) if weights is None else f64(weights).reshape(-1)
    out = np.zeros((num_rows, x.shape[1]))
    for a, r in enumerate(dest):
        if 0 <= r < num_rows:
            out[r] = x[a // TOP_K] * w[a]
    return out


def combine_ref(y, dest, weights) -> np.ndarray:
    y, dest, w = f64(y), np.asarray(dest).reshape(T, TOP_K), f64(weights)
    out = np.zeros((T, y.shape[1]))
    for t in range(T):
        for k in range(TOP_K):
            if 0 <= dest[t, k] < y.shape[0]:
                out[t] += w[t, k] * y[dest[t, k]]
    return out


def gmm_jnp(lhs, rhs, group_sizes):
    """Independent differentiable formulation: a one-hot [R, E] group mask in one einsum."""
    group_R = jnp.sum(jnp.arange(lhs.shape[0])[:, None] >= jnp.cumsum(group_sizes)[None, :], axis=1)
    onehot_RE = jax.nn.one_hot(group_R, rhs.shape[0], dtype=lhs.dtype)  # rows past the groups: all 0
    return jnp.einsum("rk,ekn,re->rn", lhs, rhs, onehot_RE, precision="highest")


def permutation_matrix(dest, num_rows) -> jax.Array:
    """P[r, a] = 1 if copy a lands on row r: permute = P @ copies, combine = P.T @ y."""
    dest = jnp.asarray(dest).reshape(-1)
    return jax.nn.one_hot(jnp.where((dest >= 0) & (dest < num_rows), dest, -1), num_rows).T


# ---------------------------------------------------------------- inputs


@st.composite
def group_sizes_st(draw, num_rows=R, num_groups=E):
    """Any split of at most num_rows rows into num_groups groups (empty ones included)."""
    total = draw(st.integers(0, num_rows))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=num_groups - 1, max_size=num_groups - 1)))
    return np.diff([0, *cuts, total]).tolist()


def randn(seed: int, shape, dtype=jnp.float32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


@st.composite
def routing_st(draw):
    """Destinations of T*TOP_K copies in a buffer of num_rows rows, some dropped (out of range)."""
    num_rows = draw(st.sampled_from([T * TOP_K + 5, T * TOP_K - 7]))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    dest = rng.permutation(max(num_rows, T * TOP_K))[: T * TOP_K]
    drop = rng.random(T * TOP_K) < draw(st.sampled_from([0.0, 0.3]))
    dest = np.where(drop, rng.choice([-1, num_rows, num_rows + 3]), dest)  # invalid -> dropped
    return num_rows, dest.astype(np.int32), seed


# ---------------------------------------------------------------- jitted ops (compiled once per backend)


@functools.cache
def gmm_fn(impl, out_dtype=None):
    return jax.jit(
        lambda x, w, gs: gmm(x, w, gs, implementation=impl, tile=TILE, preferred_element_type=out_dtype)
    )


@functools.cache
def tgmm_fn(impl):
    return jax.jit(lambda x, g, gs: tgmm(x, g, gs, implementation=impl, tile=TILE))


@functools.cache
def gmm_grad_fn(impl):
    def loss(x, w, gs, cot):
        return jnp.sum(gmm(x, w, gs, implementation=impl, tile=TILE) * cot)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


@functools.cache
def gmm_ref_grad_fn():
    return jax.jit(jax.grad(lambda x, w, gs, cot: jnp.sum(gmm_jnp(x, w, gs) * cot), argnums=(0, 1)))


@functools.cache
def permute_fn(impl, num_rows, weighted):
    if weighted:
        return jax.jit(lambda x, d, w: permute(x, d, num_rows, w, implementation=impl))
    return jax.jit(lambda x, d: permute(x, d, num_rows, implementation=impl))


@functools.cache
def combine_fn(impl):
    return jax.jit(lambda y, d, w: combine(y, d, w, implementation=impl))


# ---------------------------------------------------------------- gmm / tgmm

EXAMPLES = [[R, 0, 0, 0], [0, 0, 0, R], [0, 17, 0, 0], [5, 0, 31, 20], [3, 9, 0, 11], [0, 0, 0, 0]]


def with_examples(fn):
    for gs in EXAMPLES:
        fn = example(group_sizes=gs, seed=len(gs) + sum(gs))(fn)
    return fn


def assert_tail_not_stored(impl, out, total: int) -> None:
    """Rows past sum(group_sizes) are neither computed nor stored (gmm/api.py): XLA's reference gives
    zeros there, Pallas interpret mode leaves its NaN-initialised output as it was."""
    tail = f64(out)[total:]
    if impl == "xla":
        assert not np.any(tail), "XLA's rows past sum(group_sizes) are zeros"
    elif impl == "pallas" and platform() == "cpu":
        assert np.all(np.isnan(tail)), "a row past sum(group_sizes) was stored"


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@SETTINGS
@with_examples
@given(group_sizes=group_sizes_st(), seed=st.integers(0, 2**16))
def test_gmm_matches_numpy(impl, dtype, group_sizes, seed):
    lhs, rhs = randn(seed, (R, K), dtype), randn(seed + 1, (E, K, N), dtype)
    gs = jnp.asarray(group_sizes, jnp.int32)
    out = gmm_fn(impl)(lhs, rhs, gs)
    assert out.shape == (R, N) and out.dtype == dtype
    want, total = gmm_ref(lhs, rhs, group_sizes), sum(group_sizes)
    assert rel_err(f64(out)[:total], want[:total]) < (1e-5 if dtype == jnp.float32 else 1e-2) or not total
    assert_tail_not_stored(impl, out, total)


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@SETTINGS
@with_examples
@given(group_sizes=group_sizes_st(), seed=st.integers(0, 2**16))
def test_tgmm_matches_numpy(impl, dtype, group_sizes, seed):
    lhs, grad = randn(seed, (R, K), dtype), randn(seed + 1, (R, N), dtype)
    out = tgmm_fn(impl)(lhs, grad, jnp.asarray(group_sizes, jnp.int32))
    assert out.shape == (E, K, N) and out.dtype == dtype
    want = tgmm_ref(lhs, grad, group_sizes)
    if not np.any(want):
        assert not np.any(f64(out))
    else:
        assert rel_err(out, want) < (1e-5 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("impl", BACKENDS)
@SETTINGS
@with_examples
@given(group_sizes=group_sizes_st(), seed=st.integers(0, 2**16))
def test_gmm_gradients_match_jax_grad_of_reference(impl, group_sizes, seed):
    lhs, rhs, cot = randn(seed, (R, K)), randn(seed + 1, (E, K, N)), randn(seed + 2, (R, N))
    gs = jnp.asarray(group_sizes, jnp.int32)
    dlhs, drhs = gmm_grad_fn(impl)(lhs, rhs, gs, cot)
    want_dlhs, want_drhs = gmm_ref_grad_fn()(lhs, rhs, gs, cot)
    assert dlhs.shape == (R, K) and drhs.shape == (E, K, N)
    assert rel_err(dlhs, want_dlhs) < 1e-5 or not np.any(want_dlhs)
    assert rel_err(drhs, want_drhs) < 1e-5 or not np.any(want_drhs)
    assert np.all(f64(dlhs)[sum(group_sizes) :] == 0)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_gmm_transpose_rhs_and_its_gradients(impl):
    gs, sizes = jnp.asarray([0, 21, 18, 9], jnp.int32), [0, 21, 18, 9]
    lhs, rhs_ENK, cot = randn(11, (R, K)), randn(12, (E, N, K)), randn(13, (R, N))
    rhs_EKN = jnp.swapaxes(rhs_ENK, 1, 2)
    f = jax.jit(lambda x, w: gmm(x, w, gs, implementation=impl, tile=TILE, transpose_rhs=True))
    assert rel_err(f(lhs, rhs_ENK)[:48], gmm_ref(lhs, rhs_EKN, sizes)[:48]) < 1e-5
    got = jax.grad(lambda x, w: jnp.sum(f(x, w) * cot), (0, 1))(lhs, rhs_ENK)
    want = jax.grad(lambda x, w: jnp.sum(gmm_jnp(x, jnp.swapaxes(w, 1, 2), gs) * cot), (0, 1))(lhs, rhs_ENK)
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_tgmm_gradients_match_jax_grad_of_reference(impl):
    gs = jnp.asarray([9, 0, 30, 10], jnp.int32)
    lhs, grad, cot = randn(1, (R, K)), randn(2, (R, N)), randn(3, (E, K, N))

    def ref(x, g):  # tgmm = per-group x.T @ g, through the one-hot mask
        group_R = jnp.sum(jnp.arange(R)[:, None] >= jnp.cumsum(gs)[None, :], axis=1)
        onehot_RE = jax.nn.one_hot(group_R, E)
        return jnp.einsum("rk,rn,re->ekn", x, g, onehot_RE, precision="highest")

    got = jax.grad(lambda x, g: jnp.sum(tgmm(x, g, gs, implementation=impl, tile=TILE) * cot), (0, 1))(
        lhs, grad
    )
    want = jax.grad(lambda x, g: jnp.sum(ref(x, g) * cot), (0, 1))(lhs, grad)
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_preferred_element_type_and_bf16_gradients(impl):
    gs = jnp.asarray([20, 0, 13, 11], jnp.int32)
    lhs, rhs = randn(4, (R, K), jnp.bfloat16), randn(5, (E, K, N), jnp.bfloat16)
    out = gmm_fn(impl, jnp.float32)(lhs, rhs, gs)
    assert out.dtype == jnp.float32
    assert rel_err(out[:44], gmm_ref(lhs, rhs, [20, 0, 13, 11])[:44]) < 1e-5  # f32 accumulation, f32 output
    dlhs, drhs = jax.grad(
        lambda x, w: jnp.sum(gmm(x, w, gs, implementation=impl, tile=TILE).astype(jnp.float32)), (0, 1)
    )(lhs, rhs)
    assert dlhs.dtype == jnp.bfloat16 and drhs.dtype == jnp.bfloat16
    want_dlhs, want_drhs = jax.grad(lambda x, w: jnp.sum(gmm_jnp(x, w, gs)), (0, 1))(
        f64(lhs).astype(np.float32), f64(rhs).astype(np.float32)
    )
    assert rel_err(dlhs, want_dlhs) < 1e-2 and rel_err(drhs, want_drhs) < 1e-2


# ---------------------------------------------------------------- permute / combine


@pytest.mark.parametrize("impl", PERMUTE_BACKENDS)
@SETTINGS
@given(routing=routing_st(), weighted=st.booleans())
def test_permute_and_combine_match_numpy(impl, routing, weighted):
    num_rows, dest, seed = routing
    x, y = randn(seed, (T, D)), randn(seed + 1, (num_rows, D))
    w = jax.random.uniform(jax.random.key(seed + 2), (T, TOP_K), minval=0.1, maxval=1.0)
    if weighted:
        got = permute_fn(impl, num_rows, True)(x, dest, w)
    else:
        got = permute_fn(impl, num_rows, False)(x, dest)
    assert got.shape == (num_rows, D)
    assert rel_err(got, permute_ref(x, dest, num_rows, w if weighted else None)) < 1e-6
    got = combine_fn(impl)(y, dest, w)
    assert got.shape == (T, D)
    assert rel_err(got, combine_ref(y, dest, w)) < 1e-6


@functools.cache
def permute_combine_grad_fns(impl, num_rows):
    """jax.grad of permute and combine, and of their dense-permutation-matrix references."""

    def ref_permute(x, dest, w):  # copies in (t, k) order, scaled, then placed by P
        copies_AD = jnp.repeat(x, TOP_K, axis=0) * w.reshape(-1, 1)
        return jnp.dot(permutation_matrix(dest, num_rows), copies_AD, precision="highest")

    def ref_combine(y, dest, w):
        rows_AD = jnp.dot(permutation_matrix(dest, num_rows).T, y, precision="highest")
        return jnp.sum(rows_AD.reshape(T, TOP_K, D) * w[:, :, None], axis=1)

    def grads(f):
        return jax.jit(jax.grad(lambda a, w, dest, cot: jnp.sum(f(a, dest, w) * cot), argnums=(0, 1)))

    return (
        grads(lambda x, dest, w: permute(x, dest, num_rows, w, implementation=impl)),
        grads(ref_permute),
        grads(lambda y, dest, w: combine(y, dest, w, implementation=impl)),
        grads(ref_combine),
    )


@pytest.mark.parametrize("impl", PERMUTE_BACKENDS)
@SETTINGS
@given(routing=routing_st())
def test_permute_and_combine_gradients_match_jax_grad_of_reference(impl, routing):
    num_rows, dest, seed = routing
    x, y = randn(seed, (T, D)), randn(seed + 1, (num_rows, D))
    w = jax.random.uniform(jax.random.key(seed + 2), (T, TOP_K), minval=0.1, maxval=1.0)
    cot_R, cot_T = randn(seed + 3, (num_rows, D)), randn(seed + 4, (T, D))
    permute_grad, permute_ref_grad, combine_grad, combine_ref_grad = permute_combine_grad_fns(impl, num_rows)
    for got, want in (
        (permute_grad(x, w, dest, cot_R), permute_ref_grad(x, w, dest, cot_R)),
        (combine_grad(y, w, dest, cot_T), combine_ref_grad(y, w, dest, cot_T)),
    ):
        for a, b in zip(got, want, strict=True):
            assert rel_err(a, b) < 1e-5 or not np.any(b)


@pytest.mark.parametrize("impl", PERMUTE_BACKENDS)
def test_combine_without_weights_sums_rows_and_keeps_no_rows_for_its_gradient(impl):
    """combine(y, dest_TK) (pft at EP > 1: the weights were folded in on the expert side) equals the
    weighted combine with weights 1, in value and d y, and its VJP holds no [R, D] array: the scan
    stacks nothing for it (tests/test_scale.py)."""
    rng = np.random.default_rng(5)
    num_rows = T * TOP_K + 5
    dest = rng.permutation(num_rows)[: T * TOP_K].astype(np.int32).reshape(T, TOP_K)
    dest[0, 1] = num_rows  # a copy that was not sent
    y, cot = randn(11, (num_rows, D)), randn(12, (T, D))
    ones = jnp.ones((T, TOP_K), jnp.float32)
    got, vjp = jax.vjp(lambda a: combine(a, dest, implementation=impl), y)
    want, vjp_ref = jax.vjp(lambda a: combine(a, dest, ones, implementation=impl), y)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(vjp(cot)[0]), np.asarray(vjp_ref(cot)[0]))
    assert all(leaf.shape != y.shape for leaf in jax.tree.leaves(vjp)), "the unweighted VJP kept y"
    assert any(leaf.shape == y.shape for leaf in jax.tree.leaves(vjp_ref))  # the check can see a kept y
    with pytest.raises(ValueError, match=r"dest_A must have rank 2 \(\[tokens, top_k\] \(combine without"):
        combine(y, dest.reshape(-1))


def test_permute_accepts_dest_as_TK_and_bf16():
    dest = np.random.default_rng(0).permutation(T * TOP_K).astype(np.int32)
    x = randn(7, (T, D), jnp.bfloat16)
    flat = permute(x, dest, T * TOP_K, implementation="pallas")
    shaped = permute(x, dest.reshape(T, TOP_K), T * TOP_K, implementation="pallas")
    assert flat.dtype == jnp.bfloat16 and np.array_equal(f64(flat), f64(shaped))
    assert np.array_equal(f64(flat), permute_ref(x, dest, T * TOP_K))  # a permutation is exact


# ---------------------------------------------------------------- row-indexed gmm / tgmm (gather on load, scatter on store)
#
# Grouped row r reads lhs row src[r] and writes output row dst[r] (gmm/api.py). L lhs rows and O
# output rows differ from the R grouped rows; indices are random permutations (one case reads an
# out-of-range lhs row, which reads zeros). Shapes are fixed so each backend compiles once.

L_ROWS, O_ROWS = 70, 80
INDEX_CASES = [  # group sizes: uneven, all in one, empty, zero-row group at the end, empty groups
    [5, 0, 31, 20],
    [R, 0, 0, 0],
    [0, 0, 0, 0],
    [13, 9, 17, 0],
    [0, 17, 0, 3],
]
INDEX_MODES = {"gather": (True, False), "scatter": (False, True), "both": (True, True)}


def indexed_case(case: int, distinct: bool = True):
    """(group sizes, src [R] into L rows, dst [R] into O rows) for one case; src repeats rows
    (each lhs row read up to 3 times, like a token's K copies) when not `distinct`."""
    rng = np.random.default_rng(100 + case)
    src = rng.permutation(L_ROWS)[:R] if distinct else rng.integers(0, R // 3, R)
    if case == 0 and distinct:
        src[1] = L_ROWS + 4  # out of range: reads zeros
    return INDEX_CASES[case], src.astype(np.int32), rng.permutation(O_ROWS)[:R].astype(np.int32)


def indexed_gmm_ref(lhs, rhs, group_sizes, src, dst, num_out):
    """float64: out[dst[r]] = lhs[src[r]] @ rhs[group(r)]; also which output rows are written."""
    lhs, rhs = f64(lhs), f64(rhs)
    rows = np.arange(R) if src is None else src
    lhs_R = np.where(
        ((rows >= 0) & (rows < lhs.shape[0]))[:, None], lhs[np.clip(rows, 0, lhs.shape[0] - 1)], 0
    )
    out_R = gmm_ref(lhs_R, rhs, group_sizes)
    total = sum(group_sizes)
    dest = np.arange(R) if dst is None else dst
    out = np.zeros((num_out, rhs.shape[2]))
    out[dest[:total]] = out_R[:total]
    written = np.zeros(num_out, bool)
    written[dest[:total]] = True
    return out, written


def indexed_gmm_jnp(lhs, rhs, group_sizes, src, dst, num_out):
    """Differentiable reference: one-hot gather and scatter matrices around gmm_jnp."""
    gather_RL = jax.nn.one_hot(src, lhs.shape[0], dtype=lhs.dtype)  # out-of-range rows: zeros
    out_RN = gmm_jnp(jnp.dot(gather_RL, lhs, precision="highest"), rhs, group_sizes)
    return jnp.dot(jax.nn.one_hot(dst, num_out, dtype=lhs.dtype).T, out_RN, precision="highest")


@functools.cache
def indexed_gmm_fn(impl, gather, scatter, zero_unwritten):
    def f(x, w, gs, src, dst):
        rows = dict(lhs_rows_R=src if gather else None, out_rows_R=dst if scatter else None)
        num_out = O_ROWS if scatter else None
        return gmm(
            x,
            w,
            gs,
            **rows,
            num_out_rows=num_out,
            zero_unwritten=zero_unwritten,
            implementation=impl,
            tile=TILE,
        )

    return jax.jit(f)


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("mode", list(INDEX_MODES))
def test_indexed_gmm_matches_numpy(impl, mode):
    gather, scatter = INDEX_MODES[mode]
    for case in range(len(INDEX_CASES)):
        sizes, src, dst = indexed_case(case)
        lhs, rhs = randn(case, (L_ROWS if gather else R, K)), randn(case + 1, (E, K, N))
        gs = jnp.asarray(sizes, jnp.int32)
        num_out = O_ROWS if scatter else R
        want, written = indexed_gmm_ref(
            lhs, rhs, sizes, src if gather else None, dst if scatter else None, num_out
        )
        for zero_unwritten in (True, False):
            out = indexed_gmm_fn(impl, gather, scatter, zero_unwritten)(lhs, rhs, gs, src, dst)
            assert out.shape == (num_out, N)
            got = f64(out)
            assert rel_err(got[written], want[written]) < 1e-5 or not np.any(want[written]), (
                case,
                zero_unwritten,
            )
            if zero_unwritten:
                assert not np.any(got[~written]), f"case {case}: unwritten rows must be zeros"
            elif impl == "pallas" and platform() == "cpu":  # interpret mode's outputs start as NaN
                assert np.all(np.isnan(got[~written])), f"case {case}: a row nobody owns was stored"


@functools.cache
def indexed_grad_fns(impl, distinct):
    def loss(f, x, w, gs, src, dst, cot):
        return jnp.sum(f(x, w, gs, src, dst) * cot)

    def ours(x, w, gs, src, dst):
        return gmm(
            x, w, gs, lhs_rows_R=src, out_rows_R=dst, num_out_rows=O_ROWS, distinct_rows=distinct,
            implementation=impl, tile=TILE,
        )  # fmt: skip

    def ref(x, w, gs, src, dst):
        return indexed_gmm_jnp(x, w, gs, src, dst, O_ROWS)

    grad = jax.grad(loss, argnums=(1, 2))  # d x, d w
    return (
        jax.jit(lambda *a: grad(ours, *a)),
        jax.jit(lambda *a: grad(ref, *a)),
    )


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("distinct", [True, False], ids=["distinct", "repeated"])
def test_indexed_gmm_gradients_match_jax_grad_of_reference(impl, distinct):
    """d lhs: a scattered gmm into lhs's rows (distinct) or grouped + scatter-add (repeated)."""
    ours, ref = indexed_grad_fns(impl, distinct)
    for case in (0, 1, 3, 4):
        sizes, src, dst = indexed_case(case, distinct)
        lhs, rhs, cot = randn(case, (L_ROWS, K)), randn(case + 1, (E, K, N)), randn(case + 2, (O_ROWS, N))
        gs = jnp.asarray(sizes, jnp.int32)
        got, want = ours(lhs, rhs, gs, src, dst, cot), ref(lhs, rhs, gs, src, dst, cot)
        for a, b in zip(got, want, strict=True):
            assert np.all(np.isfinite(f64(a))), f"case {case}: non-finite gradient"
            assert rel_err(a, b) < 1e-5 or not np.any(b), case


@functools.cache
def indexed_tgmm_fns(impl):
    def ours(x, g, gs, a, b):
        return tgmm(x, g, gs, lhs_rows_R=a, grad_rows_R=b, distinct_rows=True, implementation=impl, tile=TILE)

    def ref(x, g, gs, a, b):  # gather, then the per-group sum through a one-hot group mask
        x_R = jnp.dot(jax.nn.one_hot(a, x.shape[0]), x, precision="highest")
        g_R = jnp.dot(jax.nn.one_hot(b, g.shape[0]), g, precision="highest")
        group_R = jnp.sum(jnp.arange(R)[:, None] >= jnp.cumsum(gs)[None, :], axis=1)
        return jnp.einsum("rk,rn,re->ekn", x_R, g_R, jax.nn.one_hot(group_R, E), precision="highest")

    def grads(f):
        return jax.jit(jax.grad(lambda x, g, gs, a, b, cot: jnp.sum(f(x, g, gs, a, b) * cot), argnums=(0, 1)))

    return jax.jit(ours), jax.jit(ref), grads(ours), grads(ref)


@pytest.mark.parametrize(
    "env, table, ask",
    [
        ("XMOE_TGMM_GATHER", "TGMM_GATHER_IN_KERNEL", "tgmm_gathers_in_kernel"),
        ("XMOE_GMM_GATHER", "GMM_GATHER_IN_KERNEL", "gmm_gathers_in_kernel"),
    ],
)
def test_the_gather_overrides_name_one_way_or_are_refused(env, table, ask, monkeypatch):
    """XMOE_TGMM_GATHER / XMOE_GMM_GATHER (the GPU batches' A/B runs) override the measured tables."""
    monkeypatch.setitem(getattr(defaults, table), "cpu", True)
    monkeypatch.setenv(env, "xla")
    assert not getattr(defaults, ask)()
    monkeypatch.setenv(env, "kernel")
    assert getattr(defaults, ask)()
    monkeypatch.setenv(env, "fast")
    with pytest.raises(ValueError, match=f"{env}='fast': use kernel or xla"):
        getattr(defaults, ask)()


@pytest.mark.parametrize("in_kernel", [True, False], ids=["gather-in-kernel", "xla-gathers-first"])
def test_a_gathered_gmm_and_its_gradients_match_either_way(in_kernel, monkeypatch):
    """Both ways a gmm reads indexed lhs rows into a grouped output (defaults.GMM_GATHER_IN_KERNEL): the
    Pallas kernel's gather on load, or XLA's gather and the plain kernel (no index reaches it)."""
    monkeypatch.setitem(defaults.GMM_GATHER_IN_KERNEL, "cpu", in_kernel)

    def ours(x, w, gs, src):
        return gmm(x, w, gs, lhs_rows_R=src, implementation="pallas", tile=TILE)

    def ref(x, w, gs, src):
        return gmm_jnp(jnp.dot(jax.nn.one_hot(src, x.shape[0]), x, precision="highest"), w, gs)

    def grads(f):  # rows past sum(group_sizes) are unspecified: the loss reads the live rows only
        return jax.jit(
            jax.grad(lambda x, w, gs, src, cot, live: jnp.sum(f(x, w, gs, src) * cot * live), (0, 1))
        )

    sizes, src, _ = indexed_case(1, distinct=False)  # a token's rows read several times
    x, w, cot = randn(11, (L_ROWS, K)), randn(12, (E, K, N)), randn(13, (R, N))
    gs = jnp.asarray(sizes, jnp.int32)
    live = (np.arange(R) < sum(sizes))[:, None].astype(np.float32)
    jaxpr = str(jax.make_jaxpr(ours)(x, w, gs, src))
    gathered_rows = f"f32[{R},{K}]" in jaxpr  # the grouped copy of the rows, made outside the kernel
    assert gathered_rows != in_kernel, "XLA gathers the rows exactly when the table says xla"
    got, want = f64(jax.jit(ours)(x, w, gs, src)), f64(ref(x, w, gs, src))
    assert rel_err(got[: sum(sizes)], want[: sum(sizes)]) < 1e-5
    for a, b in zip(grads(ours)(x, w, gs, src, cot, live), grads(ref)(x, w, gs, src, cot, live), strict=True):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("in_kernel", [True, False], ids=["gather-in-kernel", "xla-gathers-first"])
def test_indexed_tgmm_and_its_gradients_match_reference(impl, in_kernel, monkeypatch):
    """Both ways a tgmm reads indexed rows (defaults.TGMM_GATHER_IN_KERNEL: in the kernel, or XLA first)."""
    monkeypatch.setitem(defaults.TGMM_GATHER_IN_KERNEL, "cpu", in_kernel)
    ours, ref, ours_grad, ref_grad = indexed_tgmm_fns.__wrapped__(impl)
    for case in (0, 1, 2, 3):
        sizes, src, dst = indexed_case(case)
        src = np.where((src >= 0) & (src < L_ROWS), src, 0).astype(np.int32)
        lhs, grad, cot = randn(case, (L_ROWS, K)), randn(case + 1, (O_ROWS, N)), randn(case + 2, (E, K, N))
        gs = jnp.asarray(sizes, jnp.int32)
        want = ref(lhs, grad, gs, src, dst)
        got = ours(lhs, grad, gs, src, dst)
        assert rel_err(got, want) < 1e-5 or not np.any(f64(want)), case
        for a, b in zip(
            ours_grad(lhs, grad, gs, src, dst, cot), ref_grad(lhs, grad, gs, src, dst, cot), strict=True
        ):
            assert rel_err(a, b) < 1e-5 or not np.any(f64(b)), case


def test_indexed_argument_errors_name_the_argument():
    x, w, gs = jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.array([4, 4], jnp.int32)
    rows = jnp.arange(6, dtype=jnp.int32)
    with pytest.raises(TypeError, match="lhs_rows_R must be int32"):
        gmm(x, w, gs, lhs_rows_R=rows.astype(jnp.float32))
    with pytest.raises(ValueError, match="out_rows_R and num_out_rows must be given together"):
        gmm(x, w, gs, out_rows_R=jnp.arange(8, dtype=jnp.int32))
    with pytest.raises(ValueError, match=r"out_rows_R.shape\[0\] \(rows\) is 8 but must equal lhs_rows_R"):
        gmm(x, w, gs, lhs_rows_R=rows, out_rows_R=jnp.arange(8, dtype=jnp.int32), num_out_rows=9)
    with pytest.raises(ValueError, match="num_out_rows must be a positive int"):
        gmm(x, w, gs, out_rows_R=jnp.arange(8, dtype=jnp.int32), num_out_rows=0)
    with pytest.raises(ValueError, match=r"grad_rows_R.shape\[0\] \(rows\)"):
        tgmm(x, jnp.ones((5, 3)), gs, lhs_rows_R=rows, grad_rows_R=rows[:5])


# ---------------------------------------------------------------- every backend at default tiles: tiny here, real on GPU
#
# The former scripts/check_kernels_gpu.py, one parametrised suite at two scales. Each check runs
# one backend at its default tiles (a backend that cannot take a shape falls back, as in
# production) on fresh random inputs against float64 NumPy references, with the script's
# tolerances. Scale "tiny" runs everywhere (CPU: xla and pallas in interpret mode). Scale "gpu"
# has the script's shapes and seeds and the `gpu` marker: conftest.py skips it off-GPU; on a GPU
# run it alone with `python -m pytest -m gpu tests/test_kernels.py` (about a minute on an H100).

CHECK_TOL = {"float32": 1e-3, "bfloat16": 1e-2}  # f32: IEEE in our kernels, XLA may use TF32
# (rows, K, N, experts, fill): "uneven" has K, N and group sizes off the tiles and sum(sizes) < R;
# "aligned" suits the Mosaic tiles; "moe" is the X-MoE Small up-projection with fewer rows.
GEMM_SHAPES = {
    "tiny": {
        "uneven": (100, 40, 24, 8, 0.97),
        "aligned": (128, 64, 32, 8, 1.0),
        "moe": (256, 64, 48, 16, 0.99),
    },
    "gpu": {
        "uneven": (1000, 200, 136, 8, 0.97),
        "aligned": (8192, 512, 384, 16, 1.0),
        "moe": (16384, 2048, 1408, 64, 0.99),
    },
}
PERMUTE_SHAPES = {  # (tokens, top_k, D); 10% of the copies are dropped
    "tiny": {"f32": (24, 3, 40), "bf16": (40, 3, 72)},
    "gpu": {"f32": (1000, 6, 200), "bf16": (4096, 6, 2048)},
}
SCALES = [pytest.param("tiny"), pytest.param("gpu", marks=pytest.mark.gpu)]


def group_sizes_for(pattern, scale, shape, seed):
    """(rows, K, N, experts, sizes): "skewed" = Zipf-like sizes with 3 empty groups (the script's),
    "one_group" = every row in one group and the others empty."""
    rows, k, n, e, fill = GEMM_SHAPES[scale][shape]
    if pattern == "one_group":
        return rows, k, n, e, np.eye(e, dtype=np.int64)[e // 2] * rows
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, e + 1) ** 1.1
    p[rng.choice(e, 3, replace=False)] = 0
    return rows, k, n, e, np.floor(rng.permutation(p) / p.sum() * rows * fill).astype(np.int64)


def check_gmm(impl, scale, dtype, shape, seed, transpose=False, pattern="skewed"):
    rows, k, n, e, sizes = group_sizes_for(pattern, scale, shape, seed)
    x, w = randn(seed, (rows, k), dtype), randn(seed + 1, (e, n, k) if transpose else (e, k, n), dtype)
    f = jax.jit(
        lambda x, w, gs: gmm(x, w, gs, implementation=impl, transpose_rhs=transpose, zero_unwritten=True)
    )
    out = f(x, w, jnp.asarray(sizes, jnp.int32))
    assert not np.any(f64(out)[sizes.sum() :]), "zero_unwritten: rows past sum(group_sizes) must be zero"
    return [("out", out, gmm_ref(x, jnp.swapaxes(w, 1, 2) if transpose else w, sizes))]


def check_tgmm(impl, scale, dtype, shape, seed, pattern="skewed"):
    rows, k, n, e, sizes = group_sizes_for(pattern, scale, shape, seed)
    x, g = randn(seed, (rows, k), dtype), randn(seed + 1, (rows, n), dtype)
    out = jax.jit(lambda x, g, gs: tgmm(x, g, gs, implementation=impl))(x, g, jnp.asarray(sizes, jnp.int32))
    return [("out", out, tgmm_ref(x, g, sizes))]


def check_gmm_grads(impl, scale, dtype, shape, seed):
    rows, k, n, e, sizes = group_sizes_for("skewed", scale, shape, seed)
    x, w, cot = (
        randn(seed, (rows, k), dtype),
        randn(seed + 1, (e, k, n), dtype),
        randn(seed + 2, (rows, n), dtype),
    )
    gs = jnp.asarray(sizes, jnp.int32)

    def loss(x, w):
        return jnp.sum((gmm(x, w, gs, implementation=impl) * cot).astype(jnp.float32))

    dx, dw = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    return [("dlhs", dx, gmm_ref(cot, jnp.swapaxes(w, 1, 2), sizes)), ("drhs", dw, tgmm_ref(x, cot, sizes))]


def check_permute_combine(impl, scale, dtype, shape, seed):
    """permute and combine, and jax.grad of both, with about 10% of the copies dropped."""
    num_tokens, top_k, dim = PERMUTE_SHAPES[scale][shape]
    num_copies = num_tokens * top_k
    num_rows = int(num_copies * 0.9)
    dest = np.random.default_rng(seed).permutation(num_copies).astype(np.int32)
    dest = np.where(dest < num_rows, dest, -1).astype(np.int32)
    x, w = (
        randn(seed, (num_tokens, dim), dtype),
        jax.random.uniform(jax.random.key(seed), (num_tokens, top_k)),
    )
    y, cot_R = randn(seed + 1, (num_rows, dim), dtype), randn(seed + 2, (num_rows, dim), dtype)
    cot_T = randn(seed + 3, (num_tokens, dim), dtype)

    def grads(f, a, cot):
        return jax.jit(jax.grad(lambda a, w: jnp.sum((f(a, w) * cot).astype(jnp.float32)), (0, 1)))(a, w)

    def permute_(x, w):
        return permute(x, dest, num_rows, w, implementation=impl)

    def combine_(y, w):
        return combine(y, dest, w, implementation=impl)

    dx, dw_p = grads(permute_, x, cot_R)
    dy, dw_c = grads(combine_, y, cot_T)
    xs, ws, ys, cr, ct = f64(x), f64(w).reshape(-1), f64(y), f64(cot_R), f64(cot_T)
    ok = dest >= 0
    tok, row = (np.arange(num_copies) // top_k)[ok], dest[ok]
    want_p, want_dy = np.zeros((num_rows, dim)), np.zeros((num_rows, dim))
    want_p[row], want_dy[row] = xs[tok] * ws[ok, None], ct[tok] * ws[ok, None]
    want_c, want_dx = np.zeros((num_tokens, dim)), np.zeros((num_tokens, dim))
    np.add.at(want_c, tok, ys[row] * ws[ok, None])
    np.add.at(want_dx, tok, cr[row] * ws[ok, None])
    want_dw_p, want_dw_c = np.zeros(num_copies), np.zeros(num_copies)
    want_dw_p[ok], want_dw_c[ok] = np.sum(cr[row] * xs[tok], axis=1), np.sum(ct[tok] * ys[row], axis=1)
    return [
        ("permute", jax.jit(permute_)(x, w), want_p),
        ("combine", jax.jit(combine_)(y, w), want_c),
        ("permute dx", dx, want_dx),
        ("permute dweights", jnp.reshape(dw_p, -1), want_dw_p),
        ("combine dy", dy, want_dy),
        ("combine dweights", jnp.reshape(dw_c, -1), want_dw_c),
    ]


F32, BF16 = jnp.float32, jnp.bfloat16
CHECKS = {  # the script's checks, names and seeds, plus the one-group pattern
    "gmm_f32_uneven": functools.partial(check_gmm, dtype=F32, shape="uneven", seed=1),
    "gmm_bf16_uneven": functools.partial(check_gmm, dtype=BF16, shape="uneven", seed=2),
    "gmm_bf16_aligned": functools.partial(check_gmm, dtype=BF16, shape="aligned", seed=3),
    "gmm_bf16_moe": functools.partial(check_gmm, dtype=BF16, shape="moe", seed=4),
    "gmm_bf16_one_group": functools.partial(
        check_gmm, dtype=BF16, shape="aligned", seed=13, pattern="one_group"
    ),
    "dgrad_bf16_uneven": functools.partial(check_gmm, dtype=BF16, shape="uneven", seed=5, transpose=True),
    "dgrad_bf16_aligned": functools.partial(check_gmm, dtype=BF16, shape="aligned", seed=6, transpose=True),
    "tgmm_f32_uneven": functools.partial(check_tgmm, dtype=F32, shape="uneven", seed=7),
    "tgmm_bf16_aligned": functools.partial(check_tgmm, dtype=BF16, shape="aligned", seed=8),
    "tgmm_bf16_one_group": functools.partial(
        check_tgmm, dtype=BF16, shape="aligned", seed=14, pattern="one_group"
    ),
    "grads_f32_uneven": functools.partial(check_gmm_grads, dtype=F32, shape="uneven", seed=9),
    "grads_bf16_aligned": functools.partial(check_gmm_grads, dtype=BF16, shape="aligned", seed=10),
    "permute_combine_f32": functools.partial(check_permute_combine, dtype=F32, shape="f32", seed=11),
    "permute_combine_bf16": functools.partial(check_permute_combine, dtype=BF16, shape="bf16", seed=12),
}


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("check", list(CHECKS))
def test_backend_matches_float64_reference_at_default_tiles(check, impl, scale):
    if check.startswith("permute") and impl not in PERMUTE_BACKENDS:
        pytest.skip(f"{impl} has no permute kernels of its own (it runs pallas's)")
    tol = CHECK_TOL[jnp.dtype(CHECKS[check].keywords["dtype"]).name]
    for what, got, want in CHECKS[check](impl, scale):
        assert rel_err(got, want) <= tol, f"{check} {what} on {impl}"


# ---------------------------------------------------------------- validation and backend choice


def test_gmm_argument_errors_name_the_argument():
    x, w, gs = jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.array([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="lhs must have rank 2"):
        gmm(x[None], w, gs)
    with pytest.raises(ValueError, match="rhs must have rank 3"):
        gmm(x, w[0], gs)
    with pytest.raises(TypeError, match="group_sizes must be int32"):
        gmm(x, w, gs.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"rhs.shape\[1\] \(K\)"):
        gmm(x, jnp.ones((2, 5, 3)), gs)
    with pytest.raises(ValueError, match=r"group_sizes.shape\[0\] \(E\)"):
        gmm(x, w, jnp.array([8], jnp.int32))
    with pytest.raises(TypeError, match="lhs and rhs must share a dtype"):
        gmm(x, w.astype(jnp.bfloat16), gs)
    with pytest.raises(TypeError, match="lhs must be bfloat16, float16 or float32"):
        gmm(x.astype(jnp.int32), w, gs)
    with pytest.raises(ValueError, match="implementation must be one of"):
        gmm(x, w, gs, implementation="cuda")
    with pytest.raises(ValueError, match="powers of 2"):
        gmm(x, w, gs, implementation="pallas", tile=(16, 24, 16))
    with pytest.raises(ValueError, match=r"grad.shape\[0\] \(rows\)"):
        tgmm(x, jnp.ones((7, 3)), gs)


def test_permute_argument_errors_name_the_argument():
    x, dest, w = jnp.ones((4, 8)), jnp.arange(8, dtype=jnp.int32), jnp.ones((4, 2))
    with pytest.raises(TypeError, match="dest_A must be int32"):
        permute(x, dest.astype(jnp.float32), 8)
    with pytest.raises(ValueError, match="not a multiple of the 4 tokens"):
        permute(x, dest[:7], 8)
    with pytest.raises(ValueError, match="num_rows must be positive"):
        permute(x, dest, 0)
    with pytest.raises(ValueError, match="weights_TK has shape"):
        combine(jnp.ones((8, 8)), dest, jnp.ones((4, 3)))
    with pytest.raises(ValueError, match="y_RD must have rank 2"):
        combine(jnp.ones((8,)), dest, w)


@pytest.mark.skipif(
    _available("mgpu") and _available("triton"), reason="every backend runs here: nothing falls back"
)
def test_unavailable_backend_falls_back_to_a_correct_one():
    gs = jnp.asarray([30, 0, 6, 20], jnp.int32)
    lhs, rhs = randn(8, (R, K)), randn(9, (E, K, N))
    for impl in ("mgpu", "triton"):
        if _available(impl):
            continue
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            out = gmm(lhs, rhs, gs, implementation=impl, tile=TILE)
        assert rel_err(out, gmm_ref(lhs, rhs, [30, 0, 6, 20])) < 1e-5


def test_default_implementation_is_xla_on_cpu():
    if platform() == "cpu":
        assert default_implementation("gmm") == "xla"
        assert default_implementation("permute") == "xla"
    assert default_implementation("gmm") in IMPLEMENTATIONS
