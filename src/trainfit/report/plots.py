"""Every chart trainfit draws, with matplotlib (Agg, no display): the one module that plots.

The report's charts take the plain series from :mod:`trainfit.report.data` and return PNG bytes
(the HTML embeds them as base64, so the page needs no network and no files beside it);
``plot_memory`` and ``plot_profile`` write the ``--plot FILE.png`` pictures of ``memory`` and
``profile``. One colour per part, kept across every chart.
"""

from __future__ import annotations

import contextlib
import io
import math
import warnings
from pathlib import Path

from trainfit.errors import ConfigError
from trainfit.report.data import LossSeries
from trainfit.report.numbers import fmt_ms, tick_formatter
from trainfit.results import MemoryReport, ProfileReport
from trainfit.units import fmt_bytes
from trainfit.vocabulary import PART_LABELS, PARTS

COLORS = {  # one colour per part, kept across charts
    "params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52",
    "temporaries": "#8172B3", "data_wait": "#937860", "h2d": "#DA8BC3", "forward": "#4C72B0",
    "backward": "#DD8452", "comm_exposed": "#C44E52", "rest": "#8C8C8C",
}
SIZE_IN = (7.5, 3.2)
DPI = 100


def _plt():
    import matplotlib  # a core dependency; imported only when a chart is drawn (it costs ~0.3 s)

    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def _quiet():
    """Labels drawn as typed ("$" is not mathtext) and matplotlib's warnings about odd data kept off stderr."""
    import matplotlib

    with matplotlib.rc_context({"text.parse_math": False}), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _png(fig) -> bytes:
    buf = io.BytesIO()
    try:
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=DPI)
    finally:
        _plt().close(fig)
    return buf.getvalue()


MAX_BARS = 40
"""Bars one chart draws (the tables list every report)."""
LARGEST = 1e100
"""Values beyond this are not drawn (no loss, scale, byte count or time is that large; matplotlib's axis
arithmetic overflows near 1e308)."""


def _plottable(v: float, *, positive: bool = False, nonnegative: bool = False) -> float:
    """``v`` as a float to draw, or NaN (not drawn: a gap in a line) when it is not finite or absurdly large."""
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        return math.nan
    if not math.isfinite(f) or abs(f) > LARGEST or (positive and f <= 0) or (nonnegative and f < 0):
        return math.nan
    return f


def _label(text: str, limit: int = 70) -> str:
    """A chart label: one line of printable text, cut to ``limit`` characters."""
    text = "".join(ch if ch.isprintable() else " " for ch in str(text))
    return text if len(text) <= limit else text[:limit - 3] + "..."


def loss_png(s: LossSeries) -> bytes:
    """Loss per optimizer step; skipped steps marked with a red cross; the validation loss as points where it
    was computed; the learning rate on a second axis when it changes. Non-finite values are gaps."""
    plt = _plt()
    steps = [float(k) for k in s.steps]
    loss = [_plottable(v) for v in s.loss]
    with _quiet():
        fig, ax = plt.subplots(figsize=SIZE_IN)
        ax.plot(steps, loss, color="#4C72B0", lw=1.4, label="training loss (mean over the window's tokens)")
        val = [_plottable(v) for v in s.val_loss]
        if any(math.isfinite(v) for v in val):
            ax.plot([float(k) for k in s.val_steps], val, color="#DD8452", lw=1.0, marker="o", ms=4, zorder=3,
                    label="validation loss (token-weighted)")
        if s.lr_varies:
            _lr_axis(ax, steps, [_plottable(v) for v in s.lr])
        if s.skipped:
            finite = [v for v in loss if math.isfinite(v)]
            top = max(finite) if finite else 1.0
            at = dict(zip(s.steps, loss))
            ys = [at[k] if math.isfinite(at.get(k, math.nan)) else top for k in s.skipped]
            ax.scatter([float(k) for k in s.skipped], ys, marker="x", color="#C44E52", s=40, zorder=3,
                       label=f"skipped step ({len(s.skipped)})")
        return _per_step_png(fig, ax, "loss")


def _lr_axis(ax, steps: list[float], lr: list[float]) -> None:
    """The learning rate on a second y axis (right), dashed; its legend entry joins the main axis' legend."""
    twin = ax.twinx()
    (line,) = twin.plot(steps, lr, color="#8172B3", lw=1.0, ls="--", label="learning rate (right axis)")
    twin.set_ylabel("learning rate")
    twin.yaxis.set_major_formatter(tick_formatter(""))
    twin.set_ylim(bottom=0)
    ax.plot([], [], color=line.get_color(), lw=1.0, ls="--", label=line.get_label())  # one legend for both


def loss_scale_png(s: LossSeries) -> bytes:
    """The dynamic loss scale per step (log2 axis); skipped steps as red lines. Scales that are not finite
    and positive are gaps."""
    plt = _plt()
    with _quiet():
        fig, ax = plt.subplots(figsize=SIZE_IN)
        scale = [_plottable(v, positive=True) for v in s.loss_scale]
        ax.step([float(k) for k in s.steps], scale, where="post", color="#55A868", lw=1.4, label="loss scale")
        for i, k in enumerate(s.skipped[:1000]):
            ax.axvline(float(k), color="#C44E52", alpha=0.35, lw=1, label="skipped step" if i == 0 else None)
        if any(math.isfinite(v) for v in scale):  # a log axis of nothing positive cannot be drawn
            ax.set_yscale("log", base=2)
        return _per_step_png(fig, ax, "loss scale")


def _people_axes(ax, x_unit: str = "", y_unit: str = "") -> None:
    """Both axes' ticks written for people: thousands separators, no ``1e4`` offset or ``e`` notation."""
    ax.xaxis.set_major_formatter(tick_formatter(x_unit))
    ax.yaxis.set_major_formatter(tick_formatter(y_unit))
    ax.xaxis.set_minor_formatter("")
    ax.yaxis.set_minor_formatter("")


def _per_step_png(fig, ax, ylabel: str) -> bytes:
    """Finish a chart over optimizer steps (whole-step ticks, numbers for people, grid, legend) as PNG bytes."""
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    _people_axes(ax)
    _integer_steps(ax)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    return _png(fig)


def _integer_steps(ax) -> None:
    from matplotlib.ticker import MaxNLocator  # with matplotlib, which _plt() has loaded

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


MARK_COLOR = "#B22222"
"""The colour of a bar's note that it was measured on another configuration than the run's."""


ROW = 2.2
"""Data units between two bars that carry their labels above them (the bar is 0.8 high)."""


def _rows_size(n: int) -> tuple[float, float]:
    return SIZE_IN[0], max(2.6, 1.3 + 1.0 * n)


def _bar_labels(ax, ys: list[float], labels: list[str], marks: list[str]) -> None:
    """Each bar's label (up to two lines) above it, over the whole width, and its mark in red below it; no
    y ticks (a long configuration needs the width a tick label would squeeze the bars out of)."""
    at = ax.get_yaxis_transform()  # x in axes fraction, y in data
    for y, lab, mark in zip(ys, labels, marks):
        ax.text(0.005, y - 0.45, "\n".join(_label(line, 110) for line in str(lab).split("\n")[:2]),
                transform=at, fontsize=7.5, va="bottom", ha="left", linespacing=1.3)
        if mark:
            ax.text(0.005, y + 0.45, _label(mark, 110), transform=at, fontsize=7.5, va="top", ha="left",
                    color=MARK_COLOR, fontweight="bold")
    ax.set_yticks([])
    ax.set_ylim(ys[-1] + 1.1 if ys else 1.0, -1.6)


def _bytes_unit(top: float) -> tuple[str, float]:
    """The binary unit a bytes axis reads best in, for its largest value."""
    for unit, size in (("TiB", 2.0**40), ("GiB", 2.0**30)):
        if top >= size:
            return unit, size
    return "MiB", 2.0**20


def memory_png(labels: list[str], parts: list[dict[str, int]], peaks: list[int | None],
               marks: list[str] | None = None) -> bytes:
    """Stacked bars of the parts per configuration (the first :data:`MAX_BARS`); a black tick at the measured
    peak, and its size beside it. ``marks`` (one per bar, "" for none) is drawn in red under a bar's label: the
    bar was measured on another configuration than the run's. A value that is not a finite size is drawn as 0."""
    plt = _plt()
    labels, parts, peaks = labels[:MAX_BARS], parts[:MAX_BARS], peaks[:MAX_BARS]
    marks = (list(marks or []) + [""] * len(labels))[:len(labels)]
    sizes = [_plottable(x, nonnegative=True) for p in parts for x in p.values()]
    sizes += [_plottable(pk, positive=True) for pk in peaks if pk]
    unit, size = _bytes_unit(max([v for v in sizes if math.isfinite(v)] + [1.0]))
    ys = [ROW * i for i in range(len(labels))]
    with _quiet():
        fig, ax = plt.subplots(figsize=_rows_size(len(labels)))
        left = [0.0] * len(labels)
        for name in parts[0]:
            vals = [_plottable(p.get(name, 0) / size, nonnegative=True) for p in parts]
            vals = [v if math.isfinite(v) else 0.0 for v in vals]
            ax.barh(ys, vals, left=left, color=COLORS.get(name), label=name, height=0.8)
            left = [a + b for a, b in zip(left, vals)]
        first = True
        for i, pk in enumerate(peaks):
            x = _plottable(pk / size, positive=True) if pk else math.nan
            if math.isfinite(x):
                y = ys[i]
                ax.plot([x] * 2, [y - 0.4, y + 0.4], color="black", lw=2, label="peak" if first else None)
                ax.annotate(f" peak {fmt_bytes(pk)}", (x, y), va="center", fontsize=8)
                first = False
        _bar_labels(ax, ys, labels, marks)
        ax.set_xlabel(f"{unit} (largest live bytes of each part during one step)")
        ax.xaxis.set_major_formatter(tick_formatter())
        ax.margins(x=0.2)
        ax.set_xlim(left=0)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=8, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
        return _png(fig)


def time_png(labels: list[str], parts: list[dict[str, float]], marks: list[str] | None = None) -> bytes:
    """Stacked bars of the median step time (ms) by phase per profile (the first :data:`MAX_BARS`), each
    labelled above with what measured it and on which configuration (``labels``), its total at its end, and
    ``marks`` (one per bar, "" for none) in red: the bar was measured on another configuration, so it does not
    compare with the others. A time that is not a finite, non-negative number is drawn as 0."""
    plt = _plt()
    labels, parts = labels[:MAX_BARS], parts[:MAX_BARS]
    marks = (list(marks or []) + [""] * len(labels))[:len(labels)]
    ys = [ROW * i for i in range(len(labels))]
    with _quiet():
        fig, ax = plt.subplots(figsize=_rows_size(len(labels)))
        names = [n for n in ("data_wait", "h2d", "forward", "backward", "comm_exposed", "optimizer", "rest")
                 if any(n in p for p in parts)]
        left = [0.0] * len(labels)
        for name in names:
            vals = [_plottable(p.get(name, 0.0) * 1e3, nonnegative=True) for p in parts]
            vals = [v if math.isfinite(v) else 0.0 for v in vals]
            ax.barh(ys, vals, left=left, color=COLORS.get(name), label=name, height=0.8)
            left = [a + b for a, b in zip(left, vals)]
        for y, total in zip(ys, left):
            ax.annotate(f" {fmt_ms(total / 1e3)}", (total, y), va="center", fontsize=8)
        _bar_labels(ax, ys, labels, marks)
        ax.set_xlabel("ms per optimizer step (median)")
        ax.xaxis.set_major_formatter(tick_formatter())
        ax.margins(x=0.18)
        ax.set_xlim(left=0)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=8, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
        return _png(fig)


def plot_memory(report: MemoryReport, path: str | Path, *, budget_bytes: int | None = None) -> Path:
    """Write the plot to ``path`` (PNG) and return it."""
    plt = _plt()
    phases = [p for p in ("forward", "backward", "optimizer") if p in report.phases]
    unit, scale = ("GiB", 2**30) if report.peak_bytes >= 2**30 else ("MiB", 2**20)
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    bottoms = [0.0] * len(phases)
    for part in PARTS:
        vals = [report.phases[ph].get(part, 0) / scale for ph in phases]
        ax.bar(phases, vals, bottom=bottoms, color=COLORS[part], label=PART_LABELS[part], width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for i, ph in enumerate(phases):
        ax.text(i, bottoms[i], fmt_bytes(report.phases[ph]["peak"]), ha="center", va="bottom", fontsize=9)
    if budget_bytes:
        ax.axhline(budget_bytes / scale, color="black", linestyle="--", linewidth=1)
        ax.text(len(phases) - 0.5, budget_bytes / scale, f" budget {fmt_bytes(budget_bytes)}", va="bottom",
                ha="right", fontsize=8)
    ax.set_ylabel(f"live memory at the phase's peak ({unit})")
    ax.yaxis.set_major_formatter(tick_formatter())
    ax.set_title(f"{report.model} - {report.precision}, checkpointing={report.checkpointing}, "
                 f"micro-batch {report.batch} ({report.method})", fontsize=10)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=9, frameon=False)
    ax.set_ylim(0, max(bottoms + [budget_bytes / scale if budget_bytes else 0]) * 1.15)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


_PART_NAMES = {"data_wait": "data wait", "h2d": "host-to-device", "forward": "forward", "backward": "backward",
               "optimizer": "optimizer", "comm_exposed": "exposed comm", "rest": "rest"}


def check_plot_path(path: str) -> None:
    if not str(path).lower().endswith(".png"):
        raise ConfigError("--plot", path, "a file name ending in .png")


def plot_profile(report: ProfileReport, path: str) -> str:
    """Write a two-panel PNG to ``path``; returns the path.

    Raises:
        ConfigError: ``path`` does not end in .png.
    """
    check_plot_path(path)
    plt = _plt()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    bottom = 0.0
    for name, label in _PART_NAMES.items():
        ms = report.phases[name] * 1e3
        ax1.bar(["step"], [ms], bottom=bottom, color=COLORS.get(name), label=f"{label} {fmt_ms(ms / 1e3)}")
        bottom += ms
    ax1.set_ylabel("median time per optimizer step (ms)")
    ax1.yaxis.set_major_formatter(tick_formatter())
    ax1.set_title(f"bottleneck: {report.bottleneck}")
    ax1.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))

    sc = report.scaling
    curves = sc.get("curves", {})  # scaleout's dict (empty without a known bandwidth; {} when not stored)
    if curves:
        top = max(p["n"] for c in curves.values() for p in c["points"])
        ax2.plot([1, top], [1, top], "k--", label="ideal")
        for name, c in curves.items():
            ax2.plot([p["n"] for p in c["points"]], [p["speedup"] for p in c["points"]], marker="o", label=name)
        ax2.set_xscale("log", base=2)
        ax2.set_yscale("log", base=2)
        _people_axes(ax2)
        ax2.set_xlabel("devices")
        ax2.set_ylabel("predicted speed-up")
        ax2.set_title(f"{sc['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s link", fontsize=9)
        ax2.legend(fontsize=8)
    else:
        ax2.text(0.5, 0.5, "no scale-out prediction:\n" + str(sc.get("bandwidth_source", "")), ha="center",
                 va="center", wrap=True, fontsize=8)
        ax2.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
