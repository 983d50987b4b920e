"""The report's charts, drawn with matplotlib (Agg, no display) and returned as PNG bytes.

Each function takes the plain series from :mod:`trainfit.report.data` and returns one PNG; the
HTML embeds it as base64, so the page needs no network and no files beside it.
"""

from __future__ import annotations

import io
import math

from trainfit.errors import ConfigError
from trainfit.report.data import LossSeries

COLORS = {  # one colour per part, kept across charts
    "params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52",
    "temporaries": "#8172B3", "data_wait": "#937860", "h2d": "#DA8BC3", "forward": "#4C72B0",
    "backward": "#DD8452", "comm_exposed": "#C44E52", "optimizer_t": "#55A868", "rest": "#8C8C8C",
}
SIZE_IN = (7.5, 3.2)
DPI = 100


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed; must precede pyplot
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("report", "matplotlib", "matplotlib installed",
                          "pip install 'trainfit[plot]' (matplotlib draws the charts)") from None
    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=DPI)
    _plt().close(fig)
    return buf.getvalue()


def loss_png(s: LossSeries) -> bytes:
    """Loss per optimizer step; skipped steps marked with a red cross."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=SIZE_IN)
    ax.plot(s.steps, s.loss, color="#4C72B0", lw=1.4, label="loss (mean over the window's tokens)")
    if s.skipped:
        finite = [v for v in s.loss if math.isfinite(v)]
        top = max(finite) if finite else 1.0
        at = dict(zip(s.steps, s.loss))
        ys = [at[k] if math.isfinite(at[k]) else top for k in s.skipped]
        ax.scatter(s.skipped, ys, marker="x", color="#C44E52", s=40, zorder=3,
                   label=f"skipped step ({len(s.skipped)})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    return _png(fig)


def loss_scale_png(s: LossSeries) -> bytes:
    """The dynamic loss scale per step (log2 axis); skipped steps as red lines."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=SIZE_IN)
    ax.step(s.steps, s.loss_scale, where="post", color="#55A868", lw=1.4, label="loss scale")
    for i, k in enumerate(s.skipped):
        ax.axvline(k, color="#C44E52", alpha=0.35, lw=1, label="skipped step" if i == 0 else None)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss scale")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    return _png(fig)


def memory_png(labels: list[str], parts: list[dict[str, int]], peaks: list[int | None]) -> bytes:
    """Stacked bars of the parts (MiB) per configuration; a black tick at the measured peak."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(SIZE_IN[0], max(2.2, 0.9 + 0.55 * len(labels))))
    mib = 2.0**20
    left = [0.0] * len(labels)
    for name in parts[0]:
        vals = [p[name] / mib for p in parts]
        ax.barh(labels, vals, left=left, color=COLORS.get(name), label=name)
        left = [a + b for a, b in zip(left, vals)]
    for i, pk in enumerate(peaks):
        if pk:
            ax.plot([pk / mib] * 2, [i - 0.4, i + 0.4], color="black", lw=2, label="peak" if i == 0 else None)
    ax.invert_yaxis()
    ax.set_xlabel("MiB (largest live bytes of each part during one step)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    return _png(fig)


def time_png(labels: list[str], parts: list[dict[str, float]]) -> bytes:
    """Stacked bars of the median step time (ms) by phase per profile."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(SIZE_IN[0], max(2.2, 0.9 + 0.55 * len(labels))))
    names = [n for n in ("data_wait", "h2d", "forward", "backward", "comm_exposed", "optimizer", "rest")
             if any(n in p for p in parts)]
    left = [0.0] * len(labels)
    for name in names:
        vals = [p.get(name, 0.0) * 1e3 for p in parts]
        color = COLORS["optimizer_t"] if name == "optimizer" else COLORS.get(name)
        ax.barh(labels, vals, left=left, color=color, label=name)
        left = [a + b for a, b in zip(left, vals)]
    ax.invert_yaxis()
    ax.set_xlabel("ms per optimizer step (median)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    return _png(fig)
