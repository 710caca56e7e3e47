"""The Markdown table and the stacked-bar picture of a `step_breakdown.breakdown` report.

Apart from the reading and sorting (step_breakdown.py) so that each file stays one concern: the
table is what a benchmark note pastes (`benchmarks/*.md`), the picture what it links.
"""

from __future__ import annotations

from xmoe_jax.perf.step_breakdown import LABELS, ROWS, TraceError


def format_table(rep: dict) -> str:
    """The report as Markdown: ms per step per GPU, the mean and its share of the step."""
    gpus, mean = rep["gpus"], rep["mean"]
    steps = sorted({(r["steps"], r["steps_from"]) for r in gpus.values()})
    cols = list(gpus)
    head = (
        f"Step breakdown: {len(cols)} GPU(s), program {rep['module'] or '(unnamed)'}, "
        + ", ".join(f"{n} steps ({src})" for n, src in steps)
        + ", ms per step"
    )
    lines = [head, "", "| category | " + " | ".join(cols) + " | mean | % of step |"]
    lines.append("|---" + "|---:" * (len(cols) + 2) + "|")
    step = mean["step_ms"] or 1.0
    for cat in ROWS:
        if cat in rep["unidentified"]:
            cells, share = ["n/a"] * (len(cols) + 1), "n/a"
        else:
            cells = [f"{gpus[g]['ms'][cat]:.2f}" for g in cols] + [f"{mean['ms'][cat]:.2f}"]
            share = f"{100 * mean['ms'][cat] / step:.1f}%"
        lines.append(f"| {LABELS[cat]} | " + " | ".join(cells) + f" | {share} |")
    cells = [f"{gpus[g]['step_ms']:.2f}" for g in cols] + [f"{mean['step_ms']:.2f}"]
    lines.append("| **step (sum)** | " + " | ".join(cells) + " | 100% |")
    for key, label in (("exchange_hidden_ms", "exchange, hidden (under compute, not in the sum)"),
                       ("exchange_total_ms", "exchange, total kernel time")):  # fmt: skip
        cells = [f"{gpus[g][key]:.2f}" for g in cols] + [f"{mean[key]:.2f}"]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {100 * mean[key] / step:.1f}% |")
    lines += [
        "",
        "Each slice of time counts once, in the first of: " + " > ".join(LABELS[c] for c in ROWS) + ".",
    ]
    if mean["exchange_by_collective"]:
        lines.append(
            "Exchange by collective (mean, total / exposed ms): "
            + ", ".join(
                f"{k} {v['total_ms']:.2f} / {v['exposed_ms']:.2f}"
                for k, v in mean["exchange_by_collective"].items()
            )
        )
    lines.append(f"JAX name stack on {100 * mean['name_stack_coverage']:.0f}% of kernel time.")
    lines += ["", "Largest kernels (mean per GPU per step: ms, launches):"]
    for cat, items in rep["top_kernels"].items():
        label = LABELS.get(cat, cat)
        lines.append(f"- {label}: " + "; ".join(f"{n[:70]} {m:.2f} ms x{c:.3g}" for n, m, c in items[:3]))
    if rep.get("copies"):
        lines += ["", "Device copies by source (mean per GPU per step: ms, launches; HLO op @ name stack):"]
        lines += [f"- {src[:110]} {m:.2f} ms x{c:.3g}" for src, m, c in rep["copies"]]
    if rep.get("other_compute"):
        lines += [
            "",
            "Other compute by source (mean per GPU per step: ms, launches; kernel: HLO op @ name stack):",
        ]
        lines += [f"- {src[:140]} {m:.2f} ms x{c:.3g}" for src, m, c in rep["other_compute"]]
    lines += [f"Note: {n}" for n in rep["notes"]]
    return "\n".join(lines)


COLORS = {
    "optimizer": "#8c564b",
    "recompute": "#e377c2",
    "attention": "#1f77b4",
    "expert_gemm": "#2ca02c",
    "other_gemm": "#98df8a",
    "loop": "#bcbd22",
    "other_compute": "#9467bd",
    "other_programs": "#7f7f7f",
    "exchange_exposed": "#d62728",
    "idle": "#dddddd",
}


def plot(rep: dict, path: str) -> None:
    """A stacked bar per GPU and one for the mean: ms per step by category (matplotlib, headless)."""
    try:
        import matplotlib
    except ImportError as err:
        raise TraceError("--plot needs matplotlib: pip install 'xmoe_jax[viz]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [*rep["gpus"], "mean"]
    rows = [r["ms"] for r in rep["gpus"].values()] + [rep["mean"]["ms"]]
    fig, ax = plt.subplots(figsize=(2.5 + 0.9 * len(names), 5))
    bottom = [0.0] * len(names)
    for cat in ROWS:
        values = [r[cat] for r in rows]
        ax.bar(names, values, bottom=bottom, label=LABELS[cat], color=COLORS[cat])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("ms per step")
    ax.set_title(f"{rep['module'] or 'step'}: where the step goes")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
