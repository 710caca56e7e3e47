"""Analytic activation memory of one MoE layer, per device, in bytes (pft and padded).

Shapes per device: T tokens, K top-k, A = T*K routed copies, D model, F expert hidden
(F/TP under expert-TP), E experts, P peers on the expert axis, L = E/P local experts,
M receive rows (`pft.recv_rows`: worst case P*T*min(K, L) unless capped), C capacity.

Tokens per device: T = tokens / (data * expert), divided again by TP under SSMB. Without
SSMB every tensor rank holds the same T tokens, so the block's dispatch, expert and
combine buffers are all proportional to T and fall by the TP factor with SSMB; only
the expert weights (L*D*F) do not.

Two views:

`buffers` (the inventory, what X-MoE's "activation memory" counts): the forward
buffers of each stage,
  dispatch: send buffer A*D, receive buffer M*D, expert-grouped buffer M*D;
  experts:  hidden M*F per input matrix (gate, up), activation M*F, output M*D;
  combine:  receive-side output M*D, returned rows A*D, per-copy rows A*D (f32),
            the combined y T*D (f32);
  router:   logits, scores, combine weights, [T, E] float32.

`peak` (what `compiled.memory_analysis().temp_size_in_bytes` of a jitted
forward+backward reports): XLA frees most forward buffers as soon as it can and
recomputes cheap ones, so the peak is one stage's working set, not the inventory's
sum. It is the larger of two stages (n = expert matrices: 3 SwiGLU, 2 GELU):

  experts, backward of the last expert GEMM. The `xla` grouped GEMM of
  xmoe_jax.kernels (`ragged_dot` / `ragged_dot_general`: the backend on CPU) is
  lowered densely, every operand expanded to one masked copy per local expert:
    GEMM workspace    2 * L*M*D + 2n * L*M*F (masked gradient / hidden copies);
    expert hidden     (n + 1) * M*F (hidden recomputed per matrix, activation, gradient);
    dispatch saved    A*D send buffer (no M*D grouped buffer: the experts read the received
                      rows in place, moe/experts.py; with peers, no returned rows either: the
                      routing weights are folded in on the expert side, so the combine keeps none);
    (SwiGLU)          - 3*L*M*D from the workspace: gate and up's backward is one GEMM;
    weights           n * L*D*F (re-laid for the GEMMs);
    output cotangent  T*D.
  exchange, forward of the combine exchange (peers only):
    receive side      6 * M*D (receive, grouped and output buffers with the zeroed
                      scatter targets XLA materialises early);
    transport         2 * P*Q*D (a compact transport with a padded wire, `emulated`: the padded
                      per-peer chunks, Q = T*min(K, L), sent and received; 0 for the others);
    send side         5 * A*D;  weights 2n * L*D*F;  output cotangent T*D.

With a grouped-GEMM kernel (the Pallas / Triton / Mosaic backends on GPU: no dense
lowering) `grouped_gemm="kernel"` drops the workspace (an estimate, not checked on CPU).
The CPU check (tests/test_ssmb.py: within 10% of the compiled temp bytes) runs in
float32; XLA:CPU computes part of a bf16 layer in float32, so there its compiled
figure lies between the itemsize-2 and itemsize-4 estimates.

`padded_buffers` is the ideal per-device inventory of the capacity baseline ([E/P, C, D]
buffers with C from the whole batch); the compiled figure shows what the partitioner
adds to it (scripts/compare_sharding.py prints both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xmoe_jax.config import MeshShape, MoEConfig, ParallelConfig
from xmoe_jax.moe.pft import recv_rows
from xmoe_jax.moe.transports import get as get_transport

GROUPED_GEMMS = ("ragged_dot", "kernel")


@dataclass(frozen=True)
class LayerShapes:
    """Per-device sizes of one pft MoE layer."""

    tokens: int  # T
    routed: int  # A = T*K
    recv: int  # M
    dim: int  # D
    hidden: int  # F per device (F/TP under expert-TP)
    local_experts: int  # L
    peers: int  # P
    num_experts: int  # E
    matrices: int  # n: 3 SwiGLU, 2 GELU
    itemsize: int


def layer_shapes(
    cfg: MoEConfig, parallel: ParallelConfig, dim: int, num_tokens: int, mesh_shape: MeshShape, itemsize: int
) -> LayerShapes:
    """Per-device shapes for `num_tokens` tokens on a mesh of `mesh_shape`."""
    data, peers, tp = mesh_shape.data, mesh_shape.expert, mesh_shape.tensor
    shards = data * peers * (tp if parallel.ssmb else 1)
    if num_tokens % shards:
        raise ValueError(f"{num_tokens} tokens are not divisible by the {shards} token shards")
    tokens = num_tokens // shards
    hidden = cfg.expert_hidden // tp if parallel.expert_tensor_parallel else cfg.expert_hidden
    routed = tokens * cfg.top_k
    capacity = cfg.capacity(tokens) if cfg.capacity_factor is not None else None
    if peers > 1:
        recv = recv_rows(cfg.num_experts, cfg.top_k, tokens, peers, capacity, parallel.recv_buffer_factor)
    else:
        recv = routed
    return LayerShapes(
        tokens=tokens,
        routed=routed,
        recv=recv,
        dim=dim,
        hidden=hidden,
        local_experts=cfg.num_experts // peers,
        peers=peers,
        num_experts=cfg.num_experts,
        matrices=3 if cfg.activation == "swiglu" else 2,
        itemsize=itemsize,
    )


def buffers(s: LayerShapes) -> dict[str, dict[str, int]]:
    """Forward buffers by stage: {stage: {buffer: bytes}} (pft)."""
    b, f32 = s.itemsize, 4
    a_d, m_d, m_f = s.routed * s.dim, s.recv * s.dim, s.recv * s.hidden
    dispatch = {"send A*D": a_d * b}
    if s.peers > 1:
        dispatch |= {"receive M*D": m_d * b, "grouped M*D": m_d * b}
    return {
        "router": {"logits, scores, weights 4*T*E (f32)": 4 * s.tokens * s.num_experts * f32},
        "dispatch": dispatch,
        "experts": {
            f"hidden {s.matrices - 1}*M*F": (s.matrices - 1) * m_f * b,
            "activation M*F": m_f * b,
            "output M*D": m_d * b,
        },
        "combine": {
            **({"receive-side output M*D": m_d * b, "returned A*D": a_d * b} if s.peers > 1 else {}),
            "per-copy rows A*D (f32)": a_d * f32,
            "combined T*D (f32)": s.tokens * s.dim * f32,
        },
    }


def _pads_chunks(transport: str) -> bool:
    """Whether `transport` stages padded per-peer chunks beside its compact buffers (`emulated`)."""
    record = get_transport(transport)
    return record.layout == "compact" and record.wire == "padded"


def stages(s: LayerShapes, grouped_gemm: str = "ragged_dot", transport: str = "emulated") -> dict:
    """{stage: {term: bytes}} of the forward+backward working sets (module docstring)."""
    if grouped_gemm not in GROUPED_GEMMS:
        raise ValueError(f"grouped_gemm={grouped_gemm!r} is not one of {list(GROUPED_GEMMS)}")
    b, n = s.itemsize, s.matrices
    lmd, lmf = s.local_experts * s.recv * s.dim, s.local_experts * s.recv * s.hidden
    a_d, m_d, m_f, t_d = s.routed * s.dim, s.recv * s.dim, s.recv * s.hidden, s.tokens * s.dim
    ldf = s.local_experts * s.dim * s.hidden
    dense = grouped_gemm == "ragged_dot"
    # SwiGLU's gate and up backward is one GEMM over 2F (moe/experts.py): the dense lowering
    # expands it once, not twice. Fitted on the tiny SwiGLU cases (F = D there: whether it scales
    # with D or F is not pinned down), 3*L*M*D.
    concat_saving = 3 * lmd if n == 3 else 0
    out = {
        "experts": {
            "gemm workspace": (2 * lmd + 2 * n * lmf - concat_saving) * b if dense else 0,
            "expert hidden": (n + 1) * m_f * b,
            # the grouped buffer M*D is no longer kept: the experts regather it from the received rows.
            # Refitted when the combine stopped keeping the returned rows (2026-12-07): the compiled peaks
            # fell by 3.2-12.1 KB (tiny) and 5.7-6.2 MB (Small), and the 2 M*D "row-index copies" (the XLA
            # reference's gather of the received rows and its zeroed scatter target) and 2 A*D zeroed
            # exchange outputs counted here before no longer fit: all four cases of tests/test_ssmb.py
            # are within 10% without them, on jax 0.10.2 and 0.12.1
            "dispatch saved": a_d * b,
            "weights": n * ldf * b,
            "output cotangent": t_d * b,
        }
    }
    if s.peers > 1:
        chunk = s.tokens * min(s.routed // s.tokens, s.local_experts)
        out["exchange"] = {
            "receive side": 6 * m_d * b,
            "transport": 2 * s.peers * chunk * s.dim * b if _pads_chunks(transport) else 0,
            "send side": 5 * a_d * b,
            "weights": 2 * n * ldf * b,
            "output cotangent": t_d * b,
        }
    return out


@dataclass(frozen=True)
class Estimate:
    """Per-device activation bytes of one MoE layer."""

    shapes: LayerShapes
    by_stage: dict[str, int]  # forward inventory per stage
    peak_stage: str  # the working set that sets the peak
    peak_terms: dict[str, int]

    @property
    def dispatch_combine(self) -> int:
        """Dispatch + combine buffers (the bytes SSMB divides by TP)."""
        return self.by_stage["dispatch"] + self.by_stage["combine"]

    @property
    def inventory(self) -> int:
        return sum(self.by_stage.values())

    @property
    def peak(self) -> int:
        return sum(self.peak_terms.values())


def pft_estimate(
    cfg: MoEConfig,
    parallel: ParallelConfig,
    dim: int,
    num_tokens: int,
    mesh_shape: MeshShape,
    itemsize: int = 2,
    grouped_gemm: str = "ragged_dot",
    transport: str = "emulated",
) -> Estimate:
    """Activation memory of one pft layer per device."""
    s = layer_shapes(cfg, parallel, dim, num_tokens, mesh_shape, itemsize)
    work = stages(s, grouped_gemm, transport)
    top = max(work, key=lambda k: sum(work[k].values()))
    return Estimate(
        shapes=s,
        by_stage={k: sum(v.values()) for k, v in buffers(s).items()},
        peak_stage=top,
        peak_terms=work[top],
    )


def padded_buffers(
    cfg: MoEConfig,
    parallel: ParallelConfig,
    dim: int,
    num_tokens: int,
    mesh_shape: MeshShape,
    itemsize: int = 2,
) -> dict:
    """Ideal per-device forward buffers of the capacity baseline: {stage: bytes}.

    Capacity C = ceil(cf * T_all * K / E) from the whole batch (dropless: C = T_all); the
    [E, C, D] buffers split over the expert axis, tokens over data x expert (x tensor under
    SSMB). The partitioner is free to do worse; compare with the compiled figure.
    """
    data, peers, tp = mesh_shape.data, mesh_shape.expert, mesh_shape.tensor
    tokens = num_tokens // (data * peers * (tp if parallel.ssmb else 1))
    cap = cfg.capacity(num_tokens) if cfg.capacity_factor is not None else num_tokens
    hidden = cfg.expert_hidden // tp if parallel.expert_tensor_parallel else cfg.expert_hidden
    slots = math.ceil(cfg.num_experts / peers) * cap
    n = 3 if cfg.activation == "swiglu" else 2
    a_d = tokens * cfg.top_k * dim
    return {
        "router": 4 * tokens * cfg.num_experts * 4,
        "dispatch": (a_d + slots * dim) * itemsize,
        "experts": (n * slots * hidden + slots * dim) * itemsize,
        "combine": (slots * dim + a_d) * itemsize + a_d * 4 + tokens * dim * 4,
    }


def relative_error(estimate: float, measured: float) -> float:
    return float(abs(estimate - measured) / max(measured, 1))
