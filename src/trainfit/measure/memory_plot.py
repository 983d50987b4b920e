"""A stacked bar per phase: what fills memory at each phase's peak (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

from trainfit.measure.report import MemoryReport, fmt_bytes
from trainfit.measure.tracker import PARTS

COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52",
          "temporaries": "#8C8C8C"}
LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
          "activations": "activations", "temporaries": "temporaries"}


def plot_memory(report: MemoryReport, path: str | Path, *, budget_bytes: int | None = None) -> Path:
    """Write the plot to ``path`` (PNG) and return it."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    phases = [p for p in ("forward", "backward", "optimizer") if p in report.phases]
    unit, scale = ("GiB", 2**30) if report.peak_bytes >= 2**30 else ("MiB", 2**20)
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    bottoms = [0.0] * len(phases)
    for part in PARTS:
        vals = [report.phases[ph].get(part, 0) / scale for ph in phases]
        ax.bar(phases, vals, bottom=bottoms, color=COLORS[part], label=LABELS[part], width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for i, ph in enumerate(phases):
        ax.text(i, bottoms[i], fmt_bytes(report.phases[ph]["peak"]), ha="center", va="bottom", fontsize=9)
    if budget_bytes:
        ax.axhline(budget_bytes / scale, color="black", linestyle="--", linewidth=1)
        ax.text(len(phases) - 0.5, budget_bytes / scale, f" budget {fmt_bytes(budget_bytes)}", va="bottom",
                ha="right", fontsize=8)
    ax.set_ylabel(f"live memory at the phase's peak ({unit})")
    ax.set_title(f"{report.model} - {report.precision}, checkpointing={report.checkpointing}, "
                 f"micro-batch {report.batch} ({report.method})", fontsize=10)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=9, frameon=False)
    ax.set_ylim(0, max(bottoms + [budget_bytes / scale if budget_bytes else 0]) * 1.15)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
