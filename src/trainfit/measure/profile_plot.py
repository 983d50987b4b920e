"""PNG pictures of a profile: step time per part (stacked bar) and the predicted scaling curve.

matplotlib is imported only here, only when a plot is asked for (the ``plot`` extra).
"""

from __future__ import annotations

from trainfit.errors import ConfigError

_PARTS = (("data_wait_s", "data wait"), ("h2d_s", "host-to-device"), ("forward_s", "forward"),
          ("backward_s", "backward"), ("optimizer_s", "optimizer"), ("comm_exposed_s", "exposed comm"),
          ("rest_s", "rest"))


def check_plot_path(path: str) -> None:
    if not str(path).lower().endswith(".png"):
        raise ConfigError("--plot", path, "a file name ending in .png")


def plot_profile(report: dict, path: str) -> str:
    """Write a two-panel PNG to ``path``; returns the path.

    Raises:
        ConfigError: matplotlib is missing, or ``path`` does not end in .png.
    """
    check_plot_path(path)
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot", path, "a run with matplotlib installed", "pip install 'trainfit[plot]'") from None

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    bottom = 0.0
    for key, label in _PARTS:
        ms = report[key] * 1e3
        ax1.bar(["step"], [ms], bottom=bottom, label=f"{label} {ms:.1f} ms")
        bottom += ms
    ax1.set_ylabel("median time per optimizer step (ms)")
    ax1.set_title(f"bottleneck: {report['bottleneck']}")
    ax1.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))

    sc = report.get("scaling") or {}
    curves = sc.get("curves") or {}
    if curves:
        top = max(p["n"] for c in curves.values() for p in c["points"])
        ax2.plot([1, top], [1, top], "k--", label="ideal")
        for name, c in curves.items():
            ax2.plot([p["n"] for p in c["points"]], [p["speedup"] for p in c["points"]], marker="o", label=name)
        ax2.set_xscale("log", base=2)
        ax2.set_yscale("log", base=2)
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
