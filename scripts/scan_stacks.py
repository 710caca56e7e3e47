"""What the layer scan stacks per layer for the backward pass (issue 35 item 5), from the compiled step on CPU.

    python scripts/scan_stacks.py                       # tiny config, EP 4 on fake CPU devices, push, save_exchange
    python scripts/scan_stacks.py --set parallel.transport=bucketed

A scan saves each iteration's residuals by a dynamic-update-slice into an [L, ...] stack. Where the residual's
producer cannot write into the stack itself (a custom call: on the GPU, our exchange and GEMM kernels), XLA copies
it there: the full-depth trace's largest device copies (benchmarks/exchange.md). This compiles the train step for
this host (nothing runs) and lists every stack the forward scan body writes: its shape, its bytes per layer, and
the JAX op that produced the row (the name stack of the update). CPU fusion differs from the GPU's, but the set of
stacks is the scan's own.
"""

from __future__ import annotations

import argparse
import os
import re
from collections import Counter

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

from xmoe_jax.config import load_config  # noqa: E402
from xmoe_jax.perf.lowering import compiled_train_step_text  # noqa: E402

BASE = [
    "parallel.dispatch=pft", "mesh.data=1", "mesh.expert=4", "train.batch_size=8", "train.seq_len=64",
    "model.remat=save_exchange", "parallel.transport=push", "model.num_layers=4", "train.micro_batch_size=4",
]  # fmt: skip
_UPDATE = re.compile(r"bitcast\(%[\w.]+\), metadata=\{op_name=\"([^\"]+)\"")
_STACK = re.compile(r"^%[\w.\-]+ \(param_0[\w.]*: (\w+)\[(\d+),([\d,]*)\]")
_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1}


def forward_stacks(text: str) -> Counter:
    """(dtype[per-layer shape], producer op) -> count, over the fused computations that write one layer's slot
    of a stack in the forward scan body."""
    found: Counter = Counter()
    for comp in re.split(r"\n(?=\S)", text):
        if "dynamic-update-slice(" not in comp or "jvp()/while/body" not in comp or "transpose(" in comp:
            continue
        head, update = _STACK.match(comp), _UPDATE.search(comp)
        if head and update and "dynamic_update_index_in_dim" in comp:
            dtype, _layers, shape = head.groups()
            found[(f"{dtype}[{shape}]", update.group(1).split("jvp()/while/body/")[-1])] += 1
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--set", action="append", default=[], help="config override, as the trainer's --set")
    args = p.parse_args()
    cfg = load_config(args.config, [*BASE, *args.set])
    stacks = forward_stacks(compiled_train_step_text(cfg, cfg.mesh.expert * cfg.mesh.data))
    print("| per-layer slot | bytes | stacks | written from |\n|---|---:|---:|---|")
    for (shape, producer), count in sorted(stacks.items(), key=lambda kv: -_bytes(kv[0][0])):
        print(f"| `{shape}` | {_bytes(shape):,} | {count} | `{producer}` |")


def _bytes(shape: str) -> int:
    dtype, dims = shape.split("[")
    size = _ITEMSIZE.get(dtype, 4)
    for d in filter(None, dims.rstrip("]").split(",")):
        size *= int(d)
    return size


if __name__ == "__main__":
    main()
