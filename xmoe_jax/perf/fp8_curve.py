"""Loss curves with FP8 on and off from the same seed and data (scripts/fp8_loss_curve.py)."""

from __future__ import annotations

import json
import pathlib
import tempfile

from xmoe_jax.config import load_config
from xmoe_jax.train.loop import train


def fp8_override(name: str) -> str:
    """The model.fp8 override of a run name: "off", a recipe, or "<recipe>+fast_accum"."""
    if name == "off":
        return "model.fp8=null"
    recipe, _, extra = name.partition("+")
    fast = ", fast_accum: true" if extra == "fast_accum" else ""
    if extra not in ("", "fast_accum"):
        raise ValueError(f"FP8 run {name!r}: write a recipe name, optionally with '+fast_accum'")
    return f"model.fp8={{recipe: {recipe}{fast}}}"


def loss_curves(
    config: str, overrides: list[str], steps: int, recipes: list[str], log_every: int, on_run=None, off=True
) -> dict:
    """{"off" or run name: {step: loss}} for one run per entry, all else equal; `on_run(curves)`
    after each run (the script writes what it has, so a time limit keeps the finished runs)."""
    curves = {}
    for name in ["off", *recipes] if off else recipes:
        fp8 = fp8_override(name)
        with tempfile.TemporaryDirectory() as run_dir:
            sets = [*overrides, fp8, f"train.steps={steps}", f"train.log_every={log_every}",
                    f"train.run_dir={run_dir}", "checkpoint.enabled=false"]  # fmt: skip
            result = train(load_config(config, sets))
        curves[name] = {int(k): float(v) for k, v in sorted(result.losses.items())}
        if on_run is not None:
            on_run(curves)
    return curves


def summary(curves: dict, tail: int = 5) -> dict:
    """Mean of the last `tail` logged losses per run, and each FP8 run's gap relative to "off"."""
    means = {k: sum(list(v.values())[-tail:]) / min(tail, len(v)) for k, v in curves.items()}
    if "off" not in means:
        return {"final_mean": means}
    return {
        "final_mean": means,
        "relative_gap": {k: m / means["off"] - 1 for k, m in means.items() if k != "off"},
    }


def plot(curves: dict, path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in curves.items():
        ax.plot(list(curve), list(curve.values()), label="no FP8" if name == "off" else f"FP8 {name}")
    ax.set(xlabel="step", ylabel="train loss (log scale)", title=title, yscale="log")
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")


def write(curves: dict, meta: dict, out: pathlib.Path) -> None:
    out.write_text(json.dumps({**meta, "summary": summary(curves), "curves": curves}, indent=1))
