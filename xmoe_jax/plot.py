"""`xmoe-plot`: PNG pictures of a run from its metrics.jsonl (matplotlib, headless).

Why from metrics.jsonl: it is the run's one record of what happened (TensorBoard reads the same
numbers), it survives resumes (records are appended), and a plot needs no JAX. Written to
`<run_dir>/plots/` (or `out_dir`, created with its parents), each picture whole or not at all (a
full disk: `storage.WriteError` naming the file, no partial picture left):

  loss.png         training loss (and cross-entropy when a balance loss is added) and eval loss
                   against the step
  expert_load.png  one heat map per MoE layer: expert (rows) x logged step (columns), colour =
                   the expert's routed copies / the layer's mean (1 = balanced). A router that
                   collapses shows as one bright row and a dark rest.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from xmoe_jax import storage
from xmoe_jax.config import ConfigError
from xmoe_jax.train.rundir import RunDir

WRITE_FIX = "free space, raise the quota or the file-size limit (ulimit -f), or name another folder (--out)"


def read_metrics(run_dir: Path) -> list[dict]:
    path = RunDir(run_dir).metrics
    if not path.is_file():
        raise ConfigError(
            f"{run_dir} holds no metrics.jsonl; pass the run directory xmoe-train wrote (--run-dir)"
        )
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    nan = float("nan")  # metrics.jsonl writes a non-finite value as null
    return [{k: nan if v is None else v for k, v in r.items()} for r in records]


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ConfigError("xmoe-plot needs matplotlib: pip install 'xmoe_jax[viz]'") from e
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _loss_png(plt, train: list[dict], evals: list[dict], title: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = [r["step"] for r in train]
    ax.plot(steps, [r["loss"] for r in train], label="train loss", color="tab:blue")
    if any(abs(r.get("ce", r["loss"]) - r["loss"]) > 1e-6 for r in train):
        ax.plot(steps, [r["ce"] for r in train], label="train cross-entropy", color="tab:blue", ls="--", lw=1)
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["eval_loss"] for r in evals],
            "o-",
            label="eval loss",
            color="tab:orange",
        )
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    _save(plt, fig, path)


def _save(plt, fig, path: Path) -> None:
    """The figure as a PNG at `path`, through a temporary name: whole or not at all."""
    try:
        with storage.replacing(path) as tmp:
            fig.savefig(tmp, dpi=100, format="png")
    except storage.WriteError as e:
        raise e.with_fix(WRITE_FIX) from e
    finally:
        plt.close(fig)


MAX_EXPERT_LABELS = 16


def expert_ticks(num_experts: int, most: int = MAX_EXPERT_LABELS) -> list[int]:
    """The experts whose rows get a label: all up to `most`, then every k-th (at most `most`)."""
    return list(range(0, num_experts, -(-num_experts // most)))


def _expert_load_png(plt, train: list[dict], title: str, path: Path) -> None:
    with_load = [r for r in train if r.get("expert_load")]
    steps = [r["step"] for r in with_load]
    load_TLE = np.asarray([r["expert_load"] for r in with_load], dtype=np.float64)
    num_layers, num_experts = load_TLE.shape[1], load_TLE.shape[2]
    vmax = max(2.0, float(load_TLE.max()))
    layer_height = min(3.0, max(1.6, 0.12 * num_experts))  # inches: room for 16 labels
    fig, axes = plt.subplots(num_layers, 1, figsize=(9, 1.0 + layer_height * num_layers), squeeze=False)
    half = (steps[-1] - steps[0]) / max(2 * (len(steps) - 1), 1) or 0.5  # half a column, in steps
    for layer, ax in enumerate(axes[:, 0]):
        image = ax.imshow(
            load_TLE[:, layer, :].T,
            aspect="auto",
            origin="lower",
            interpolation="nearest",
            cmap="magma",
            vmin=0.0,
            vmax=vmax,
            extent=(steps[0] - half, steps[-1] + half, -0.5, num_experts - 0.5),
        )
        ax.set(ylabel="expert", title=f"MoE layer {layer}")
        ticks = expert_ticks(num_experts)
        ax.set_yticks(ticks, [str(e) for e in ticks], fontsize=8 if len(ticks) > 8 else None)
        fig.colorbar(image, ax=ax, label="load / mean")
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    _save(plt, fig, path)


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Writes the PNGs of a run; returns their paths."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    if not train:
        raise ConfigError(
            f"{run_dir}/metrics.jsonl holds no training records yet; plot after the first log step"
        )
    plt = _pyplot()
    out = Path(out_dir) if out_dir is not None else RunDir(run_dir).plots
    try:
        with storage.writing(out):
            out.mkdir(parents=True, exist_ok=True)
    except storage.WriteError as e:
        raise e.with_fix(WRITE_FIX) from e
    written = [out / "loss.png"]
    _loss_png(plt, train, evals, f"{run_dir.name}: loss", written[0])
    if any(r.get("expert_load") for r in train):
        written.append(out / "expert_load.png")
        _expert_load_png(plt, train, f"{run_dir.name}: expert load per MoE layer", written[-1])
    return written
