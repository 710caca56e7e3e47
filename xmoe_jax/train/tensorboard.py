"""TensorBoard event files for a run (`<run_dir>/tensorboard`), written with tensorboardX.

Why a sink of metric records: the loop already builds one record per log step (and one per
evaluation) for metrics.jsonl; this writes the same records as TensorBoard summaries, so the two
never disagree and the loop knows nothing about TensorBoard.

  train/<key>                    loss, ce, aux_loss, z_loss, mtp_loss (with MTP), grad_norm, lr,
                                 tokens_per_s, tflops_per_device, mfu
  eval/loss, eval/perplexity     per evaluation
  moe/imbalance/layer_<i>        max/mean routed copies of MoE layer i (i counts MoE layers)
  moe/drop_rate/layer_<i>        dropped share of routed copies
  moe/recv_imbalance/layer_<i>   pft/rbd: max/mean rows received per device
  moe/exchange_bound_ratio/layer_<i>  pft/rbd: (P-1) x the largest pair / the busiest device's
                                 sends or receives (what an exact exchange could gain on a dense one)
  moe/expert_load/layer_<i>      histogram whose x axis is the expert index and whose height is
                                 the expert's load (routed copies / mean): a collapsed router
                                 shows as one tall bar
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

TRAIN_SCALARS = (
    "loss",
    "ce",
    "aux_loss",
    "z_loss",
    "mtp_loss",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "tflops_per_device",
    "mfu",
)
EVAL_SCALARS = {"eval_loss": "eval/loss", "eval_ppl": "eval/perplexity"}
LAYER_SCALARS = {
    "expert_imbalance": "imbalance",
    "drop_rate": "drop_rate",
    "recv_imbalance": "recv_imbalance",
    "exchange_bound_ratio": "exchange_bound_ratio",
}


class TensorBoardWriter:
    """Writes metric records (the dicts of metrics.jsonl) as summaries."""

    def __init__(self, log_dir: Path) -> None:
        from tensorboardX import SummaryWriter

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(str(self.log_dir), flush_secs=30)

    def write(self, record: dict) -> None:
        step = int(record["step"])
        for key in TRAIN_SCALARS:
            if record.get(key) is not None:
                self._writer.add_scalar(f"train/{key}", float(record[key]), step)
        for key, tag in EVAL_SCALARS.items():
            if key in record:
                self._writer.add_scalar(tag, float(record[key]), step)
        for key, name in LAYER_SCALARS.items():
            for i, value in enumerate(record.get(key, [])):
                self._writer.add_scalar(f"moe/{name}/layer_{i}", float(value), step)
        for i, load_E in enumerate(record.get("expert_load", [])):
            self._expert_histogram(f"moe/expert_load/layer_{i}", np.asarray(load_E, dtype=np.float64), step)
        self._writer.flush()

    def _expert_histogram(self, tag: str, load_E: np.ndarray, step: int) -> None:
        experts_E = np.arange(len(load_E), dtype=np.float64)
        self._writer.add_histogram_raw(
            tag,
            min=0.0,
            max=float(len(load_E) - 1),
            num=float(load_E.sum()),
            sum=float((experts_E * load_E).sum()),
            sum_squares=float((experts_E**2 * load_E).sum()),
            bucket_limits=(experts_E + 0.5).tolist(),
            bucket_counts=load_E.tolist(),
            global_step=step,
        )

    def close(self) -> None:
        self._writer.close()
