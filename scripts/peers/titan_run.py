"""Run torchtitan 0.2.2's own Trainer on the peer shape and write tokens/s and peak memory as JSON.

    python scripts/peers/titan_run.py --config configs/tiny_small_shape.yaml --ac selective --steps 30 \
        --out titan_sel.json

The model is torchtitan's Qwen3 with MoE in every layer, registered at run time as the flavour
`xmoe_peer`: no qk-norm, MHA (n_kv_heads = n_heads), gated experts of equal FLOPs (960 for our
1408), softmax top-k with normalised weights, grouped GEMMs (`torch._grouped_mm`), SDPA attention,
fp32 parameters under bf16 autocast, AdamW. The data are random tokens (no tokenizer, no dataset):
the `qwen3` train spec is re-registered with a synthetic loader. --ac: none, full, selective
(op-level SAC, the `op` option) or selective:N (every N-th block). --no-compile runs eagerly (the
CPU smoke test).

One GPU: run it with python (WORLD_SIZE 1, no FSDP). Expert parallel over N GPUs: under torchrun,
one process per GPU, with --ep N:

    torchrun --standalone --nproc_per_node 4 scripts/peers/titan_run.py --ep 4 --ac selective ...

torchtitan 0.2.2 takes EP from the data-parallel shard dimension (parallel_dims.py: efsdp =
dp_shard x cp x tp / (ep x etp) must be whole), so `--parallelism.expert_parallel_degree=N` runs
with `data_parallel_shard_degree` = WORLD_SIZE (its default -1): FSDP2 shards the dense
parameters over the N ranks (and does the bf16 mixed precision there, not autocast), the routed
experts are split N ways (ExpertParallel: all-to-all of the routed tokens), and every rank reads
its own --batch-size sequences (the global batch is N times it). Rank 0 writes the JSON: tokens/s of
the whole job, its own memory.

Throughput: wall time of the last third of the steps, synchronised at both ends. Memory:
torch.cuda.max_memory_allocated and max_memory_reserved over the whole run (torchtitan's own
resets of the peak at each log line are switched off).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_shape import PeerShape, load_shape  # noqa: E402

FLAVOUR = "xmoe_peer"


def stub_datasets() -> None:
    """Hugging Face `datasets`, which torchtitan's text loader imports, as scripts/peers/stubs/hf_datasets
    where the machine lacks it (the stubs folder on PYTHONPATH: scripts/bench_peers.sh)."""
    try:
        import datasets  # noqa: F401  # the real one
    except ImportError:
        import hf_datasets
        import hf_datasets.distributed

        sys.modules["datasets"], sys.modules["datasets.distributed"] = hf_datasets, hf_datasets.distributed


def register(shape: PeerShape, batch_size: int, seq_len: int, grouped_mm: bool) -> None:
    """The flavour and a synthetic-data copy of the qwen3 train spec (looked up before the built-in)."""
    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.models import qwen3
    from torchtitan.models.moe import MoEArgs
    from torchtitan.protocols.train_spec import register_train_spec

    qwen3.qwen3_args[FLAVOUR] = qwen3.Qwen3ModelArgs(
        vocab_size=shape.vocab_size,
        max_seq_len=seq_len,
        head_dim=shape.head_dim,
        dim=shape.hidden,
        n_layers=shape.num_layers,
        n_heads=shape.num_heads,
        n_kv_heads=shape.num_kv_heads,
        qk_norm=False,
        hidden_dim=shape.gated_expert_hidden,  # unused: every layer is MoE
        rope_theta=10000,
        moe_enabled=True,
        moe_inter_dim=shape.gated_expert_hidden,
        moe_args=MoEArgs(
            num_experts=shape.num_experts,
            num_shared_experts=0,
            top_k=shape.top_k,
            score_func="softmax",
            route_norm=True,
            route_scale=1.0,
            score_before_experts=False,
            use_grouped_mm=grouped_mm,
        ),
    )

    class SyntheticLoader(BaseDataLoader):
        """Random tokens, as MaxText's dataset_type=synthetic and our data.source: synthetic."""

        def __init__(self, seed: int):
            self.gen = torch.Generator().manual_seed(seed)

        def __iter__(self):
            while True:
                tokens = torch.randint(0, shape.vocab_size, (batch_size, seq_len + 1), generator=self.gen)
                yield {"input": tokens[:, :-1]}, tokens[:, 1:]

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            pass

    spec = qwen3.get_train_spec()
    register_train_spec(
        "qwen3",
        dataclasses.replace(
            spec,
            build_tokenizer_fn=None,
            build_dataloader_fn=lambda dp_world_size, dp_rank, tokenizer, job_config: SyntheticLoader(
                dp_rank
            ),
        ),
    )


def job_args(shape: PeerShape, args, dump_folder: str) -> list[str]:
    ac = args.ac.split(":")
    out = [
        "--model.name=qwen3",
        f"--model.flavor={FLAVOUR}",
        f"--training.local_batch_size={args.batch_size or shape.batch_size}",
        f"--training.seq_len={args.seq_len or shape.seq_len}",
        f"--training.steps={args.steps}",
        f"--training.max_norm={shape.grad_clip}",
        "--training.dtype=float32",
        "--training.mixed_precision_param=bfloat16",
        f"--optimizer.lr={shape.lr}",
        f"--optimizer.weight_decay={shape.weight_decay}",
        f"--lr_scheduler.warmup_steps={min(5, args.steps)}",
        f"--metrics.log_freq={args.steps}",
        f"--job.dump_folder={dump_folder}",
        "--checkpoint.no-enable",
        f"--parallelism.expert_parallel_degree={args.ep}",
        f"--activation_checkpoint.mode={ac[0]}",
        "--compile.no-enable" if args.no_compile else "--compile.enable",
        "--compile.components=model,loss",
    ]
    if ac[0] == "selective":
        out.append(f"--activation_checkpoint.selective_ac_option={ac[1] if len(ac) > 1 else 'op'}")
    return out + args.extra


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config", default="configs/tiny_small_shape.yaml", help="the xmoe_jax config whose shape to run"
    )
    p.add_argument("--ac", default="selective", help="none | full | selective[:op|:N]")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=None, help="default: the config's")
    p.add_argument("--seq-len", type=int, default=None, help="default: the config's")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument(
        "--loop-experts", action="store_true", help="a for-loop over experts, not torch._grouped_mm"
    )
    p.add_argument(
        "--tiny", action="store_true", help="dims cut to 64 wide, 4 experts, 2 layers (smoke test)"
    )
    p.add_argument("--cpu", action="store_true", help="CPU smoke test (gloo, no memory figures)")
    p.add_argument(
        "--ep", type=int, default=1, help="expert-parallel degree (under torchrun: must divide WORLD_SIZE)"
    )
    p.add_argument("--out", default=None)
    p.add_argument("extra", nargs="*", help="more torchtitan --section.key=value arguments (after --)")
    args = p.parse_args()
    if args.ac.split(":")[0] not in ("none", "full", "selective"):
        raise SystemExit(f"--ac {args.ac!r}: use none, full, selective, selective:op or selective:N")

    shape = load_shape(args.config)
    if args.tiny:
        shape = dataclasses.replace(
            shape, hidden=64, num_heads=4, num_kv_heads=4, head_dim=16, num_layers=2, num_experts=4, top_k=2,
            expert_hidden=48, vocab_size=256,
        )  # fmt: skip
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.ep < 1 or world % args.ep or (args.ep > 1 and shape.num_experts % args.ep):
        raise SystemExit(
            f"--ep {args.ep}: must divide the process count ({world}: torchrun --nproc_per_node) "
            f"and the expert count ({shape.num_experts})"
        )
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")

    import torch

    stub_datasets()
    import torchtitan
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    if args.cpu:
        import titan_cpu

        titan_cpu.install()
    batch = args.batch_size or shape.batch_size
    seq_len = args.seq_len or shape.seq_len
    register(shape, batch, seq_len, grouped_mm=not args.loop_experts)
    cuda = torch.cuda.is_available() and not args.cpu
    marks: dict[int, float] = {}
    window = max(args.steps // 3, 1)
    start_step = args.steps - window

    class TimedTrainer(Trainer):
        def train_step(self, data_iterator):
            if self.step - 1 == start_step:  # self.step is already the step about to run
                if cuda:
                    torch.cuda.synchronize()
                marks[start_step] = time.perf_counter()
            super().train_step(data_iterator)
            if self.step == args.steps:
                if cuda:
                    torch.cuda.synchronize()
                marks[args.steps] = time.perf_counter()

    init_logger()
    with tempfile.TemporaryDirectory() as tmp:
        config = ConfigManager().parse_args(job_args(shape, args, tmp))
        t0 = time.perf_counter()
        trainer = TimedTrainer(config)
        trainer.metrics_processor.device_memory_monitor.reset_peak_stats = lambda: None
        log = trainer.metrics_processor.log
        losses: dict[int, float] = {}

        def log_and_keep(step, global_avg_loss, *rest, **kwargs):
            losses[step] = float(global_avg_loss)
            return log(step, global_avg_loss, *rest, **kwargs)

        trainer.metrics_processor.log = log_and_keep
        try:
            trainer.train()
        finally:
            trainer.close()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        wall_s = time.perf_counter() - t0

    if int(os.environ.get("RANK", "0")) != 0:
        return
    step_s = (marks[args.steps] - marks[start_step]) / window
    tokens = batch * seq_len * world  # every rank is a data-parallel shard: its own batch
    out = {
        "system": "torchtitan",
        "version": torchtitan.__version__,
        "policy": args.ac,
        "compile": not args.no_compile,
        "grouped_mm": not args.loop_experts,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": args.config,
        "args": job_args(shape, args, "<tmp>"),
        "gated_expert_hidden": shape.gated_expert_hidden,
        "batch_size": batch,  # per GPU
        "num_gpus": world,
        "ep": args.ep,
        "tokens_per_step": tokens,
        "steps": args.steps,
        "window_steps": window,
        "step_s": step_s,
        "first_loss": losses.get(min(losses)) if losses else None,
        "final_loss": losses.get(max(losses)) if losses else None,
        "tokens_per_s": tokens / step_s,
        "wall_s": wall_s,
        "max_memory_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        "max_memory_reserved": torch.cuda.max_memory_reserved() if cuda else None,
    }
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
