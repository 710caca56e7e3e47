"""How the model is placed: the device mesh and the MoE placement (dispatch, transport, buffers,
overlap). A checkpoint resumes under any of these settings."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

from xmoe_jax.config.checks import _check, _check_choices, _check_numbers
from xmoe_jax.config.choices import Dispatch, Overlap, Transport, XlaScheduler


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is placed on the mesh: nothing here changes the parameters, so a checkpoint
    resumes under any of these settings (train with rbd, resume with pft).

    dispatch: how routed tokens reach their experts (moe/dispatchers.py): `auto` (the default: `pft`
      wherever the model has routed experts, settled by `settle`), `pft` (padding-free, dropless:
      the product path), `rbd` (two-stage, across nodes), `padded` (capacity baseline), `dense`
      (the numerical oracle: every expert on every token, for tests).
    transport: the pft/rbd exchange (moe/transports.py, one record each): `bucketed` (dense
      all-to-all of per-peer chunks sized by the buffer factor), `exact` (ragged_all_to_all split
      into many updates per peer; one process on GPU), `ragged` (ragged_all_to_all; not on CPU),
      `emulated` (its exact emulation, the CPU default), `push` (our Mosaic-GPU kernel writing rows
      into the peers' receive buffers; Hopper, one process per host); `auto` = bucketed on GPU.
    recv_buffer_factor: pft/rbd receive buffers hold factor x the average routed rows (None =
      the worst case). With adaptive_buffers this is where the trainer starts (None: 1.2).
    adaptive_buffers: dropless pft/rbd training sizes the buffers itself (moe/ladder.py,
      train/buffers.py): a step whose copies do not fit is not applied and reruns on the ladder's
      smallest rung that holds its peak (1.05 ... 3 x the average, then the worst case); after
      `buffer_shrink_after` steps in a row that fit a smaller rung it moves down to the smallest
      one that holds all their peaks. None: the transport's pace (moe/ladder.py: 20 steps, and
      never for `push`, which keeps one receive buffer per run); a number shrinks any transport.
    overlap_chunks: pft/rbd split the block's tokens into this many chunks, each dispatched on
      its own, so one chunk's exchange can run while another's experts compute.
    overlap: how pft/rbd order the block so its all-to-alls can run under GEMMs (moe/overlap.py,
      docs/exchange.md#overlap); the values are the same, only the program order changes.
      `shared`: the shared experts run inside the block between the dispatch and the combine
      exchanges (when mesh.tensor == 1; under TP they stay a column/row-split MLP after the block);
      `chunks`: the `overlap_chunks` chunks are software-pipelined (chunk i+1's dispatch is issued
      before chunk i's expert GEMMs; needs overlap_chunks >= 2); `both`; `none` (chunks, if any, in
      sequence).
    xla_scheduler: `latency_hiding` turns on XLA's latency-hiding scheduler on GPU (the flags of
      xla_flags.SCHEDULER_PRESETS, added by the CLI before JAX starts; flags already in XLA_FLAGS
      win), so async all-to-alls are overlapped with independent compute; `default`: XLA's own.
    ssmb: with tensor parallelism, each tensor rank routes, dispatches, computes and combines
      1/TP of the block's tokens (sequence-sharded MoE block); off, every tensor rank repeats the
      block on the same tokens. Off by default because it changes pft's capacity shards (drops are
      decided per data x expert x tensor shard); turn it on whenever mesh.tensor > 1.
    expert_tensor_parallel: each expert's hidden F split over the tensor axis, tokens replicated
      over it, partial outputs summed (the alternative to SSMB, for comparison).
    auto_shard: pft only: the padding-free algorithm on the whole batch under jit with logical
      sharding annotations only (no shard_map), leaving placement to XLA's partitioner.
    sequence_parallel: under tensor parallelism, also split the residual stream's sequence over
      the tensor axis between blocks (norms, residual adds).
    route_groups_by_node: group-limited routing (moe.num_groups, moe.topk_groups) is node-limited
      routing: group g is exactly the experts of expert node g (experts are numbered node-major),
      so a token's copies reach at most moe.topk_groups nodes. Needs moe.num_groups ==
      mesh.expert_nodes (checked against the mesh at start-up); rbd then sizes its cross-node
      send buffer by topk_groups pilots per token instead of min(top_k, nodes) and reports the
      most nodes any token reached (`max_nodes_per_token`).
    ragged_decomposed: a fact, not a choice: whether XLA rewrites the ragged all-to-all into a dense
      one (the `decomposer` preset took effect), so `wire_bytes` counts whole receive buffers.
      xmoe_jax/resolve.py sets it at start-up from the flags the backend started with; moe/ reads it
      instead of the process's XLA flags. A value written in a config is replaced there.
    """

    dispatch: Dispatch = "auto"
    transport: Transport = "auto"
    recv_buffer_factor: float | None = None
    adaptive_buffers: bool = True
    buffer_shrink_after: int | None = None
    overlap_chunks: int = 1
    overlap: Overlap = "none"
    xla_scheduler: XlaScheduler = "default"
    ssmb: bool = False
    expert_tensor_parallel: bool = False
    auto_shard: bool = False
    sequence_parallel: bool = False
    route_groups_by_node: bool = False
    ragged_decomposed: bool = False

    def __post_init__(self) -> None:
        p = "parallel."
        _check_choices(self, p)
        dispatch = settled_dispatch(self.dispatch, has_experts=True)  # as an MoE model runs it
        if self.recv_buffer_factor is not None:
            _check(
                self.recv_buffer_factor > 0,
                f"{p}recv_buffer_factor={self.recv_buffer_factor} must be > 0 (or null for the worst case)",
            )
        _check(
            self.buffer_shrink_after is None or self.buffer_shrink_after >= 1,
            f"{p}buffer_shrink_after={self.buffer_shrink_after} must be >= 1 (or null for the transport's pace)",
        )
        _check(self.overlap_chunks >= 1, f"{p}overlap_chunks={self.overlap_chunks} must be >= 1")
        if self.overlap != "none":
            _check(
                dispatch in ("pft", "rbd") and not self.auto_shard,
                f"{p}overlap={self.overlap!r} orders pft/rbd's exchange inside the block's shard_map "
                f"(dispatch={self.dispatch!r}{', auto_shard' if self.auto_shard else ''}); set "
                f"{p}dispatch=pft or rbd (auto_shard=false), or {p}overlap=none",
            )
        _check(
            self.overlap not in ("chunks", "both") or self.overlap_chunks >= 2,
            f"{p}overlap={self.overlap!r} pipelines the block's chunks but {p}overlap_chunks="
            f"{self.overlap_chunks}; set {p}overlap_chunks=2 (or more), or {p}overlap=shared/none",
        )
        _check(
            not (self.ssmb and self.expert_tensor_parallel),
            f"{p}ssmb and {p}expert_tensor_parallel are alternatives (SSMB splits the tokens over the "
            "tensor axis, expert-TP splits each expert's hidden over it); set one of them to false",
        )
        _check(
            not self.auto_shard or dispatch == "pft",
            f"{p}auto_shard applies to dispatch='pft' ({self.dispatch!r} is always placed by XLA's "
            f"partitioner); set {p}auto_shard=false",
        )
        _check_numbers(self, p)

    def settle(self, has_experts: bool) -> ParallelConfig:
        """This placement with its dispatch settled (`settled_dispatch`). `Config` settles its own
        (config/run.py); `moe.layer.moe_layer` and `model.functional.model_spec` one passed to them
        bare. Nothing downstream sees `auto`."""
        dispatch = settled_dispatch(self.dispatch, has_experts)
        return self if dispatch == self.dispatch else dataclasses.replace(self, dispatch=dispatch)


def settled_dispatch(dispatch: Dispatch, has_experts: bool) -> Dispatch:
    """`auto` made concrete: `pft` (padding-free, dropless: the product path) wherever the model has
    routed experts. A model without them reads no dispatch, so `auto` stays as written there."""
    return "pft" if dispatch == "auto" and has_experts else dispatch


class MeshShape(NamedTuple):
    """Resolved mesh sizes (sharding.py names the axes they become)."""

    data: int
    expert_nodes: int
    expert_per_node: int
    tensor: int

    @property
    def expert(self) -> int:
        return self.expert_nodes * self.expert_per_node

    @property
    def batch_shards(self) -> int:
        """How many shards the batch is split into: data x expert."""
        return self.data * self.expert


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh: data x expert x tensor. `data=-1` takes the remaining devices.

    `expert` is the expert-parallel degree; `expert_nodes` factors it into nodes x
    devices per node (node-major) for RBD, whose stage 1 crosses nodes and stage 2
    stays inside one. A single host can stand in for several nodes.
    """

    data: int = -1
    expert: int = 1
    tensor: int = 1
    expert_nodes: int = 1
    fsdp: bool = False  # also shard parameters and optimizer state over `data`

    def __post_init__(self) -> None:
        _check(self.data == -1 or self.data >= 1, f"mesh.data={self.data} must be >= 1 or -1 (fill)")
        _check(self.expert >= 1, f"mesh.expert={self.expert} must be >= 1")
        _check(self.tensor >= 1, f"mesh.tensor={self.tensor} must be >= 1")
        _check(
            self.expert_nodes >= 1 and self.expert % self.expert_nodes == 0,
            f"mesh.expert_nodes={self.expert_nodes} must divide mesh.expert={self.expert} "
            "(devices per node = expert / expert_nodes)",
        )
        _check_numbers(self, "mesh.")

    def resolve(self, num_devices: int) -> MeshShape:
        """Axis sizes for `num_devices`; errors if they cannot multiply to it, naming sizes that fit."""
        fixed = self.expert * self.tensor
        if self.data == -1:
            _check(
                num_devices % fixed == 0,
                f"mesh.expert * mesh.tensor = {fixed} does not divide the {num_devices} devices; "
                f"{self._fit(num_devices)}",
            )
            data = num_devices // fixed
        else:
            data = self.data
            _check(
                data * fixed == num_devices,
                f"mesh size data*expert*tensor = {data}*{self.expert}*{self.tensor} = {data * fixed} "
                f"!= {num_devices} devices; set mesh.data=-1 (fill) or sizes whose product is {num_devices}"
                + ("" if num_devices % fixed == 0 else f": {self._fit(num_devices)}"),
            )
        return MeshShape(data, self.expert_nodes, self.expert // self.expert_nodes, self.tensor)

    def _fit(self, num_devices: int) -> str:
        """The fix for expert x tensor axes too big for `num_devices`: the largest divisors that fit
        (on one device: mesh.expert=1), or the device count to run on (faked on a CPU)."""
        expert = math.gcd(self.expert, num_devices)
        tensor = math.gcd(self.tensor, num_devices // expert)
        sets = [f"mesh.expert={expert}"] if expert != self.expert else []
        sets += [f"mesh.tensor={tensor}"] if tensor != self.tensor else []
        if self.expert_nodes > 1 and expert % self.expert_nodes:
            sets.append(f"mesh.expert_nodes={math.gcd(self.expert_nodes, expert)}")
        need = self.expert * self.tensor
        return (
            f"set {' '.join(sets)}, or run on a multiple of {need} devices (a CPU fakes "
            f"them: XLA_FLAGS=--xla_force_host_platform_device_count={need})"
        )
