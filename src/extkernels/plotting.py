"""Plots of the book, all from timing DataFrames (chapter 1 onward; see
:mod:`extkernels.timing`).

Every figure names the hardware it was measured on in its title, so a reader never has to guess.
"""

from __future__ import annotations

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

__all__ = ["timing_bars", "scaling_plot", "timeline_plot"]

# Compact PNGs: stored notebooks stay small.
mpl.rcParams.update({"figure.dpi": 90, "savefig.dpi": 90, "figure.figsize": (7.0, 3.2)})


def timing_bars(df: pd.DataFrame, *, title: str, hardware: str, log: bool = False):
    """Grouped horizontal bars of forward and training milliseconds per variant.

    Args:
        df: indexed by variant, with ``forward_ms`` and ``train_ms`` columns.
        title: what is compared; hardware: where it was measured (shown in the title).
        log: logarithmic time axis, for variants that differ by orders of magnitude.

    Returns:
        The matplotlib figure.
    """
    fig, ax = plt.subplots(figsize=(7.0, 0.55 * len(df) + 1.2))
    y = np.arange(len(df))
    h = 0.38
    bars_f = ax.barh(y - h / 2, df["forward_ms"], h, label="forward (no_grad)")
    bars_t = ax.barh(y + h / 2, df["train_ms"], h, label="training step")
    for bars in (bars_f, bars_t):
        ax.bar_label(bars, fmt="%.3g", padding=2, fontsize=8)
    ax.set_yticks(y, df.index)
    ax.invert_yaxis()
    ax.set_xlabel("ms per iteration" + (" (log scale)" if log else ""))
    if log:
        ax.set_xscale("log")
    ax.margins(x=0.15)
    ax.set_title(f"{title} — {hardware}", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def scaling_plot(
    df: pd.DataFrame, *, x: str, y: str, by: str, title: str, hardware: str, ylabel: str
):
    """Log-log lines of ``y`` against ``x``, one line per value of ``by``.

    Returns:
        The matplotlib figure.
    """
    fig, ax = plt.subplots()
    for name, part in df.groupby(by, sort=False):
        ax.plot(part[x], part[y], marker="o", label=str(name))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"{title} — {hardware}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def timeline_plot(tl: pd.DataFrame, *, title: str, hardware: str):
    """Kernels and host waits of :func:`extkernels.profiling.timeline` as horizontal bars.

    Returns:
        The matplotlib figure.
    """
    lanes = list(dict.fromkeys(tl["lane"]))
    fig, ax = plt.subplots(figsize=(7.0, 0.6 * len(lanes) + 1.2))
    colors = {"GPU kernels": "tab:blue", "host waits": "tab:red"}
    for i, lane in enumerate(lanes):
        part = tl[tl["lane"] == lane]
        ax.broken_barh(
            list(zip(part["start_ms"], part["end_ms"] - part["start_ms"], strict=True)),
            (i - 0.35, 0.7),
            color=colors.get(lane, "tab:gray"),
        )
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("time (ms)")
    ax.set_title(f"{title} — {hardware}", fontsize=10)
    fig.tight_layout()
    return fig
