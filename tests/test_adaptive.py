"""Dropless that never stops: adaptive receive buffers, the chunked (bucketed) exchange, overlap
chunks and wire accounting, on 8 fake CPU devices (data 2 x expert 4; rbd: 2 nodes x 2).

Skew: sigmoid routing whose selection bias sends almost every token to experts 0 and 1 (both on
the first expert device): that device receives about four times the average, so a buffer sized
near the average overflows and the trainer must grow it.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import trainer_parts

from xmoe_jax.config import MeshConfig, MoEConfig, ParallelConfig, load_config
from xmoe_jax.moe import init_moe_params, moe_layer
from xmoe_jax.moe.ladder import RUNGS, SHRINK_AFTER, BufferLadder
from xmoe_jax.sharding import make_mesh
from xmoe_jax.train import headroom
from xmoe_jax.train.buffers import AdaptiveStep
from xmoe_jax.train.errors import TrainingError

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
STEPS = 20


def _cfg(tmp_path, *over):
    return load_config(
        CONFIGS / "tiny.yaml",
        [
            f"train.run_dir={tmp_path}",
            "train.batch_size=16",
            "train.seq_len=16",
            f"train.steps={STEPS}",
            "model.dtype=float32",
            "mesh.data=2",
            "mesh.expert=4",
            "model.moe.score_func=sigmoid",
            "checkpoint.enabled=false",
            *over,
        ],
    )


def _skewed_run(cfg, num_steps: int = STEPS):
    """num_steps train steps from a state whose router bias favours experts 0 and 1 (heavy skew)."""
    from xmoe_jax.data import make_input

    p = trainer_parts.build(cfg)
    mesh, opt, shardings, state, sh = p.mesh, p.optimizer, p.shardings, p.state, p.batch_sharding
    with jax.set_mesh(mesh):
        skew = jnp.zeros((cfg.model.moe.num_experts,)).at[:2].set(2.0)
        bias = jax.tree.map(lambda b: jax.device_put(b + skew, b.sharding), state.bias)
        state = state.replace(bias=bias)
        step_fn = AdaptiveStep(cfg, opt, mesh, shardings)
        data = make_input(
            cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size, vocab_size=256
        )
        losses, drops, overflow = [], [], []
        for step in range(1, num_steps + 1):
            batch = {k: jax.device_put(v, sh) for k, v in next(data).items()}
            state, metrics = step_fn(state, batch, step)
            # the ladder waits for every step: its metrics come back on the host (train/headroom.py)
            assert not step_fn.ladder.active or not any(isinstance(v, jax.Array) for v in metrics.values())
            losses.append(float(metrics["loss"]))
            drops.append(float(np.asarray(metrics["drop_rate"]).max()))
            overflow.append(int(metrics.get("num_overflow", 0)))
            imbalance = (
                np.asarray(metrics["tokens_per_expert"]).max()
                / np.asarray(metrics["tokens_per_expert"]).mean()
            )
    return losses, drops, overflow, step_fn.ladder, imbalance


@functools.cache
def _oracle(tmp_root):
    return _skewed_run(_cfg(tmp_root / "dense", "parallel.dispatch=dense"))


@pytest.mark.parametrize(
    "name, over",
    [
        ("pft-bucketed", ("parallel.dispatch=pft", "parallel.transport=bucketed")),
        pytest.param(
            "pft-compact", ("parallel.dispatch=pft", "parallel.transport=emulated"), marks=pytest.mark.slow
        ),
        pytest.param(
            "rbd-bucketed",
            ("parallel.dispatch=rbd", "mesh.expert_nodes=2", "parallel.transport=bucketed"),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_skewed_dropless_run_grows_buffers_never_drops_and_equals_dense(
    tmp_path_factory, monkeypatch, name, over
):
    root = tmp_path_factory.getbasetemp()
    want, _, _, _, imbalance = _oracle(root)
    assert imbalance > 3  # heavy skew: the busiest expert gets > 3x the mean
    # every rung's first run holds a cushion under its temporaries, freed after (train/headroom.py)
    monkeypatch.setattr(headroom, "PLATFORMS", (jax.default_backend(),))
    monkeypatch.setattr(headroom, "CUSHION_BYTES", 4096)
    cushions = []
    reserve, release = headroom.reserve, headroom.release

    def reserve_once(mesh):
        cushion = reserve(mesh)
        cushions.append([cushion.addressable_shards[0].data.nbytes, False])
        return cushion

    def release_after(cushion, outputs):
        release(cushion, outputs)
        if cushion is not None:  # steady state: nothing held, nothing to free
            cushions[-1][1] = cushion.is_deleted()

    monkeypatch.setattr(headroom, "reserve", reserve_once)
    monkeypatch.setattr(headroom, "release", release_after)
    losses, drops, overflow, ladder, _ = _skewed_run(
        _cfg(root / name, *over, "parallel.recv_buffer_factor=1.1")
    )
    assert 2 <= len(cushions) <= ladder.changes + 1  # one per rung's first run (it grew at least once)
    assert cushions == [[4096, True]] * len(cushions)  # one shard per device, freed after that run
    assert len(losses) == STEPS and max(drops) == 0.0 and max(overflow) == 0  # every applied step: no drop
    assert ladder.changes >= 1 and ladder.factor != 1.1  # it grew from the smallest rung
    for got, ref in zip(losses, want, strict=True):
        assert abs(got - ref) <= 1e-5 * abs(ref), (name, losses, want)


def test_push_starts_on_the_first_rung_and_only_grows(tmp_path_factory):
    """One receive buffer per run (push, issue 36): the ladder's usual start, grown on overflow and never
    shrunk (a worst-case start was measured slower at full depth: buffers.py), equal to the dense oracle."""
    root = tmp_path_factory.getbasetemp()
    want = _oracle(root)[0]
    losses, drops, overflow, ladder, _ = _skewed_run(
        _cfg(root / "push", "parallel.dispatch=pft", "parallel.transport=push"), num_steps=3
    )
    assert max(drops) == 0.0 and max(overflow) == 0
    assert ladder.shrink_after is None and ladder.changes >= 1 and ladder.factor != 1.2  # grew (heavy skew)
    for got, ref in zip(losses, want, strict=False):
        assert abs(got - ref) <= 1e-5 * abs(ref), (losses, want)


def test_an_overflowed_step_leaves_the_state_untouched(tmp_path):
    cfg = _cfg(
        tmp_path,
        "parallel.dispatch=pft",
        "parallel.adaptive_buffers=false",
        "parallel.recv_buffer_factor=0.3",
    )
    before = jax.tree.map(np.asarray, trainer_parts.build(cfg).state)
    tokens = jax.random.randint(jax.random.key(0), (16, 16), 0, 256)
    after, metrics = trainer_parts.one_step(cfg, tokens, tokens)
    assert int(metrics["num_overflow"]) > 0
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)  # params, optimizer, bias, step and RNG


def test_fixed_buffers_stop_and_no_checkpoint_holds_the_overflowed_step(tmp_path):
    from xmoe_jax.train.checkpoint import Checkpointer
    from xmoe_jax.train.loop import train

    cfg = _cfg(
        tmp_path / "run", "parallel.dispatch=pft", "parallel.adaptive_buffers=false",
        "parallel.recv_buffer_factor=0.3", "checkpoint.enabled=true", "checkpoint.every=1", "train.log_every=5",
    )  # fmt: skip
    with pytest.raises(TrainingError, match="adaptive_buffers"):
        train(cfg)
    with Checkpointer(tmp_path / "run" / "checkpoints", cfg.checkpoint) as ckpt:
        assert ckpt.all_steps() == []


@pytest.mark.slow  # ~35 s; the ladder in the trainer: test_skewed_dropless_run_...[pft-bucketed]
def test_adaptive_run_in_the_trainer_logs_changes_and_matches_worst_case(tmp_path):
    from xmoe_jax.train.loop import train

    common = ("parallel.dispatch=pft", "parallel.transport=bucketed", "train.steps=5", "train.log_every=5")
    adaptive = train(_cfg(tmp_path / "a", *common, "parallel.recv_buffer_factor=1.1"))
    worst = train(_cfg(tmp_path / "w", *common, "parallel.adaptive_buffers=false"))
    record = adaptive.records[-1]
    assert record["buffer_changes"] >= 1 and record["buffer_factor"] > 1.1
    rows = np.asarray(record["exchange_rows"])  # per MoE layer, [P, P] over the expert axis
    assert rows.shape[1:] == (4, 4) and len(record["exchange_bound_ratio"]) == rows.shape[0]
    assert rows.sum() == 16 * 16 * 2 * rows.shape[0]  # the logged step: tokens x top-2, every copy counted
    assert all(r <= w for r, w in zip(record["wire_bytes"], worst.records[-1]["wire_bytes"], strict=True))
    for step, loss in worst.losses.items():
        assert abs(adaptive.losses[step] - loss) <= 1e-6 * abs(loss)


def test_ladder_grows_to_the_peak_and_shrinks_after_quiet_steps():
    ladder = BufferLadder(ParallelConfig(dispatch="pft", buffer_shrink_after=3), active=True)
    assert ladder.factor == 1.2
    ladder.grow(step=1, overflow=5, peak_ratio=1.6)
    assert ladder.factor == 1.75 and ladder.changes == 1  # straight to the smallest rung holding 1.6 x 1.05
    ladder.grow(step=2, overflow=5, peak_ratio=9.0)
    assert ladder.factor is None  # the worst case
    ladder.index = RUNGS.index(3.0)
    ladder.observe(3, peak_ratio=1.08)
    ladder.observe(4, peak_ratio=1.21)  # the window's largest peak decides the rung
    assert ladder.factor == 3.0 and ladder.quiet == 2
    ladder.observe(5, peak_ratio=1.1)
    assert (
        ladder.factor == 1.3 and ladder.changes == 3
    )  # one move, straight past 2.5 ... 1.4: 1.21 / 0.95 fits 1.3
    ladder.observe(6, peak_ratio=1.26)  # does not fit a smaller rung with 5% to spare: the count restarts
    assert ladder.quiet == 0 and ladder.factor == 1.3
    ladder.observe(7, peak_ratio=1.0)
    ladder.observe(8, peak_ratio=2.0)  # a spike between quiet steps restarts the count too
    assert ladder.quiet == 0 and ladder.factor == 1.3


def test_a_resumed_ladder_starts_where_the_run_had_grown_to():
    push = ParallelConfig(dispatch="pft", transport="push")
    ladder = BufferLadder(push, active=True, peers=4)
    ladder.grow(step=8, overflow=9, peak_ratio=2.07)
    assert ladder.state()["recv_buffer_factor"] == 2.5
    resumed = BufferLadder(push, active=True, peers=4)  # a new process: the usual start
    resumed.resume(ladder.state(), step=40)
    assert resumed.factor == 2.5 and resumed.changes == 0  # nothing compiled yet: not a change
    # a ladder that shrank resumes where it was, below the start, not at the start
    bucketed = ParallelConfig(dispatch="pft", transport="bucketed")
    shrunk = BufferLadder(bucketed, active=True, peers=4)
    shrunk.index = RUNGS.index(1.05)
    again = BufferLadder(bucketed, active=True, peers=4)
    again.resume(shrunk.state(), step=60)
    assert again.factor == 1.05
    # other settings start afresh: peers, transport, a start the user changed
    worst = BufferLadder(push, active=True, peers=4)
    worst.index = len(RUNGS) - 1
    for other in (
        BufferLadder(push, active=True, peers=8),
        BufferLadder(dataclasses.replace(push, transport="bucketed"), active=True, peers=4),
        BufferLadder(dataclasses.replace(push, recv_buffer_factor=1.5), active=True, peers=4),
    ):
        start = other.factor
        other.resume(worst.state(), step=3)
        assert other.factor == start
    for saved in (None, {}):  # a checkpoint without it (an older xmoe_jax): the usual start
        fresh = BufferLadder(push, active=True, peers=4)
        fresh.resume(saved, step=3)
        assert fresh.factor == 1.2
    off = BufferLadder(dataclasses.replace(push, recv_buffer_factor=1.5), active=False)
    off.resume({"recv_buffer_factor": 3.0}, step=3)  # the ladder does not apply: the fixed factor
    assert off.factor == 1.5 and off.state() is None


@pytest.mark.slow  # two short runs of the trainer (~40 s)
def test_a_resumed_run_does_not_grow_its_buffers_again(tmp_path):
    from xmoe_jax.train.loop import train

    common = (
        "parallel.dispatch=pft", "parallel.transport=bucketed", "parallel.recv_buffer_factor=1.05",
        "checkpoint.enabled=true", "checkpoint.every=3", "train.log_every=1",
    )  # fmt: skip
    first = train(_cfg(tmp_path, *common, "train.steps=3"))
    grown = first.records[-1]
    assert grown["buffer_changes"] >= 1 and grown["buffer_factor"] > 1.05
    resumed = train(_cfg(tmp_path, *common, "train.steps=4"), resume=True)
    (record,) = [r for r in resumed.records if r["step"] == 4]
    assert record["buffer_factor"] >= grown["buffer_factor"]
    # it started on the grown rung; no grow back up to it (a step 4 past it could still grow once)
    assert record["buffer_changes"] == 0 or record["buffer_factor"] > grown["buffer_factor"]


def test_ladder_a_transient_spike_costs_tens_of_steps():
    """The full-depth failure of issue 29: buffers climbed to 3x on an early spike and stayed there
    while 1.13x was needed. With the default hysteresis they come back within buffer_shrink_after steps."""
    ladder = BufferLadder(ParallelConfig(dispatch="pft"), active=True)
    ladder.grow(step=10, overflow=100, peak_ratio=2.8)
    assert ladder.factor == 3.0
    for step in range(11, 11 + SHRINK_AFTER):
        ladder.observe(step, peak_ratio=1.13)
    assert ladder.factor == 1.2 and ladder.changes == 2


# ----------------------------------------------------------------------------- the layer: bucketed, chunks, accounting

D, T = 16, 256
CFG = MoEConfig(num_experts=8, top_k=2, expert_hidden=16, num_shared_experts=1)


@functools.cache
def _layer(par: ParallelConfig, mesh_cfg: MeshConfig | None):
    mesh = make_mesh(mesh_cfg) if mesh_cfg is not None else None

    def loss(p, x):
        y, stats = moe_layer(p, x, CFG, par, mesh=mesh)
        return jnp.sum(y * jnp.sin(x)) + stats.aux_loss, (y, stats)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _inputs():
    params = init_moe_params(jax.random.key(0), D, CFG, std=0.3)
    return params, jax.random.normal(jax.random.key(1), (T, D))


def test_wire_and_routed_bytes_are_exact():
    """routed: 2 x rows sent off-device x D x 4 bytes; bucketed wire: 2 x (P-1) x C rows, whatever the routing."""
    params, x = _inputs()
    par = ParallelConfig(dispatch="pft", transport="bucketed", recv_buffer_factor=1.25)
    (_, (_, stats)), _ = _layer(par, MeshConfig(data=2, expert=4))(params, x)
    idx = np.asarray(jax.lax.top_k(jax.nn.softmax(x @ params["router"]["kernel"]), 2)[1])
    t_loc, peers = T // 8, 4
    dest = idx // 2  # 2 experts per expert device
    me = np.arange(T) // t_loc % peers  # the expert rank of each token's source device
    routed = [(dest[d * t_loc : (d + 1) * t_loc] != me[d * t_loc]).sum() for d in range(8)]
    if int(stats.num_overflow) == 0:
        np.testing.assert_array_equal(np.asarray(stats.routed_bytes), 2 * np.asarray(routed) * D * 4)
    chunk = int(np.ceil(1.25 * t_loc * 2 / peers))
    np.testing.assert_array_equal(np.asarray(stats.wire_bytes), 2 * (peers - 1) * chunk * D * 4)
    assert np.all(np.asarray(stats.buffer_rows) == chunk)
    # the source x destination matrix of expert ranks, summed over the 2 data shards
    rows = np.zeros((peers, peers), np.int64)
    np.add.at(rows, (np.repeat(me, 2), dest.reshape(-1)), 1)
    np.testing.assert_array_equal(np.asarray(stats.exchange_rows), rows)


def test_exchange_bound_ratio():
    from xmoe_jax.train.metrics import exchange_bound_ratio

    assert exchange_bound_ratio(np.full((4, 4), 10)) == 1.0  # uniform: a dense exchange is exact
    hot = np.full((4, 4), 10)
    hot[0, 1] = 30  # one 3x hot pair: dense moves 3 x 30, the busiest device 50
    assert exchange_bound_ratio(hot) == pytest.approx(90 / 50)
    diag = np.full((4, 4), 10)
    diag[2, 2] = 1000  # rows a device keeps never travel
    assert exchange_bound_ratio(diag) == 1.0
    assert exchange_bound_ratio(np.diag([5, 5])) == 1.0  # nothing crosses devices


def test_dispatch_mode_configs_keep_working_with_dataclass_replace():
    par = dataclasses.replace(ParallelConfig(dispatch="pft"), overlap_chunks=2)
    assert par.overlap_chunks == 2


@pytest.mark.slow  # ~20 s; the ladder itself: test_adaptive_run_in_the_trainer_...
def test_micro_batch_statistics_keep_buffer_peaks_as_maxima(tmp_path):
    """Counts add up over micro-batches; the fullest buffer is the max, not the sum (the ladder reads it)."""
    over = ("parallel.dispatch=pft", "parallel.transport=bucketed", "parallel.adaptive_buffers=false")
    whole, m_whole = _one_step(_cfg(tmp_path / "w", *over))
    micro, m_micro = _one_step(_cfg(tmp_path / "m", *over, "train.micro_batch_size=8"))
    assert float(m_micro["peak_ratio"]) < 1.5 * float(m_whole["peak_ratio"])  # not ~2x: a max
    np.testing.assert_array_equal(m_micro["tokens_per_expert"], m_whole["tokens_per_expert"])


def _one_step(cfg):
    tokens = jax.random.randint(jax.random.key(0), (16, 16), 0, 256)
    return trainer_parts.one_step(cfg, tokens, tokens)


def test_push_keeps_one_receive_buffer_grown_rarely_never_shrunk():
    """The push transport's record says its buffers do not shrink: after a grow, quiet steps move nothing,
    so a run settles on one buffer (one compiled step) instead of a recompile at every shrink. A pace the
    user names (parallel.buffer_shrink_after) shrinks it like any transport's."""
    ladder = BufferLadder(ParallelConfig(dispatch="pft", transport="push"), active=True)
    ladder.grow(step=1, overflow=5, peak_ratio=1.6)
    assert ladder.factor == 1.75 and ladder.changes == 1
    for step in range(2, 40):
        ladder.observe(step, peak_ratio=1.0)
    assert ladder.factor == 1.75 and ladder.changes == 1
    paced = BufferLadder(ParallelConfig(dispatch="pft", transport="push", buffer_shrink_after=3), active=True)
    paced.grow(step=1, overflow=5, peak_ratio=1.6)
    for step in range(2, 5):
        paced.observe(step, peak_ratio=1.0)
    assert paced.factor == 1.1 and paced.changes == 2  # peak 1.0 with SHRINK_MARGIN to spare
    assert (
        BufferLadder(ParallelConfig(dispatch="pft", transport="bucketed"), active=True).shrink_after
        == SHRINK_AFTER
    )
