"""Plots of the book, all from timing DataFrames (chapter 1 onward; see
:mod:`extkernels.timing`).

Every figure names the hardware it was measured on in its title, so a reader never has
to guess.
"""

from __future__ import annotations

import textwrap

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

__all__ = [
    "clouds_figure",
    "geometry_panels",
    "scaling_plot",
    "timeline_plot",
    "timing_bars",
    "range_bars",
]

# Compact PNGs, so stored notebooks stay small, and narrow ones: a 560-px figure with
# 10-point text keeps its labels legible when a phone's 420-px screen scales it down.
WIDTH = 5.6
mpl.rcParams.update(
    {
        "figure.dpi": 100,
        "savefig.dpi": 100,
        "figure.figsize": (WIDTH, 3.4),
        "font.size": 10,
        "axes.titlesize": 10,
        "legend.fontsize": 9,
    }
)


def _spread(df: pd.DataFrame, metric: str):
    """Error bars from the median to the min and max of repeated runs, or None."""
    lo, hi = f"{metric}_min", f"{metric}_max"
    if lo not in df or hi not in df:
        return None
    median = df[f"{metric}_ms"]
    return np.vstack([median - df[lo], df[hi] - median])


def _bars(ax, df: pd.DataFrame, log: bool):
    """Forward and training bars of ``df`` on ``ax``, each median labelled; returns the
    two bar containers (for a legend)."""
    y = np.arange(len(df))
    h = 0.38
    whiskers = {"capsize": 2, "elinewidth": 0.8, "ecolor": "0.25"}
    bars_f = ax.barh(
        y - h / 2,
        df["forward_ms"],
        h,
        xerr=_spread(df, "forward"),
        error_kw=whiskers,
        label="forward (no_grad)",
    )
    bars_t = ax.barh(
        y + h / 2,
        df["train_ms"],
        h,
        xerr=_spread(df, "train"),
        error_kw=whiskers,
        label="training step",
    )
    for offset, metric in ((-h / 2, "forward"), (h / 2, "train")):
        ends = df.get(f"{metric}_max", df[f"{metric}_ms"])
        _label_bars(ax, y + offset, df[f"{metric}_ms"], ends)
    ax.set_yticks(y, df.index)
    ax.invert_yaxis()
    ax.set_xlabel("ms per iteration" + (" (log scale)" if log else ""))
    if log:
        ax.set_xscale("log")
        _plain_log_ticks(ax.xaxis, df[["forward_ms", "train_ms"]].to_numpy())
    ax.margins(x=0.15)
    return bars_f, bars_t


def _label_bars(ax, y, values, ends) -> None:
    """Each bar's value (:func:`_ms_label`) just past its whisker or its end."""
    for yi, value, end in zip(y, values, ends, strict=True):
        ax.annotate(
            _ms_label(value),
            (end, yi),
            xytext=(3, 0),
            textcoords="offset points",
            va="center",
            fontsize=9,
        )


def _plain_log_ticks(axis, values) -> None:
    """Label a log ``axis`` with plain numbers: at 1, 2 and 5 x 10^n where ``values``
    span less than two decades (matplotlib would label crowded minor ticks there), at
    10^n beyond; minor ticks unlabelled."""
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values) & (values > 0)]
    narrow = values.size and values.max() < 100 * values.min()
    axis.set_major_locator(
        mpl.ticker.LogLocator(subs=(1.0, 2.0, 5.0) if narrow else (1.0,))
    )
    axis.set_major_formatter(mpl.ticker.FuncFormatter(lambda v, _: _plain_number(v)))
    axis.set_minor_formatter(mpl.ticker.NullFormatter())


def _plain_number(v: float) -> str:
    """0.5, 20, 1000 as they are; from 10^4 up (and below 10^-3) as powers of ten."""
    if v <= 0 or 1e-3 <= v < 1e4:
        return f"{v:g}"
    exponent = int(np.floor(np.log10(v) + 1e-9))
    mantissa = v / 10.0**exponent
    if abs(mantissa - 1) < 1e-6:
        return f"$10^{{{exponent}}}$"
    return f"${mantissa:g}\\times10^{{{exponent}}}$"


def _ms_label(value: float) -> str:
    """A bar's time (ms or µs) with the same number of decimals at every magnitude:
    three significant digits from 0.1 up (0.266, 3.20, 87.9, 144), three decimals
    below."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def _suptitle(df: pd.DataFrame, title: str, hardware: str) -> str:
    runs = int(df["repeats"].min()) if "repeats" in df else 1
    note = f", median of {runs} runs (whiskers: min-max)" if runs > 1 else ""
    return f"{title}\n{hardware}{note}"


def timing_bars(df: pd.DataFrame, *, title: str, hardware: str, log: bool = False):
    """Grouped horizontal bars of forward and training milliseconds per variant: medians
    of repeated runs, with whiskers from the fastest to the slowest run where the frame
    has them (see :func:`extkernels.timing.timings_frame`).

    Args:
        df: indexed by variant, with ``forward_ms`` and ``train_ms`` columns.
        title: what is compared; hardware: where it was measured (shown in the title).
        log: logarithmic time axis, for variants that differ by orders of magnitude.

    Returns:
        The matplotlib figure.
    """
    fig, ax = plt.subplots(figsize=(WIDTH, 0.6 * len(df) + 1.6), layout="constrained")
    handles = _bars(ax, df, log)
    fig.suptitle(_suptitle(df, title, hardware))
    # Right under the axis label, where it covers no bar.
    fig.legend(handles=handles, loc="outside lower center", ncol=2, frameon=False)
    return fig


def range_bars(
    df: pd.DataFrame,
    *,
    value: str,
    low: str,
    high: str,
    title: str,
    hardware: str,
    xlabel: str,
    by: str | list[str] | None = None,
    log: bool = False,
):
    """One quantity per row as horizontal bars, each labelled, with whiskers from
    ``low`` to ``high`` (chapter 5's build-up, chapter 10's calls and kernels): a panel
    per group of the index levels ``by`` (stacked, each titled by its group), or one
    panel.

    Args:
        df: a row per bar, labelled by its index (the levels not in ``by``, joined by
            " · "); columns ``value``, ``low`` and ``high`` in one unit.
        xlabel: the quantity and its unit, in words.
        log: logarithmic axis, for bars that differ by orders of magnitude.

    Returns:
        The matplotlib figure.
    """
    groups = list(df.groupby(level=by, sort=False)) if by is not None else [(None, df)]
    levels = [n for n in df.index.names if by is None or n not in np.atleast_1d(by)]
    labels = {  # long names on up to three lines, so that the bars keep the column
        key: [
            textwrap.fill(
                " · ".join(str(v) for v in np.atleast_1d(row)),
                28,
                break_long_words=False,
            )
            for row in (
                part.index.droplevel(by) if by is not None and levels else part.index
            )
        ]
        for key, part in groups
    }
    lines = max(label.count("\n") + 1 for names in labels.values() for label in names)
    rows = [len(part) for _, part in groups]
    fig, axes = plt.subplots(
        len(groups),
        1,
        figsize=(WIDTH, (0.18 + 0.14 * lines) * sum(rows) + 0.7 * len(groups) + 0.9),
        gridspec_kw={"height_ratios": rows},
        squeeze=False,
        sharex=True,
        layout="constrained",
    )
    for ax, (key, part) in zip(axes[:, 0], groups, strict=True):
        y = np.arange(len(part))
        spread = np.vstack([part[value] - part[low], part[high] - part[value]])
        ax.barh(
            y, part[value], 0.6, xerr=spread, capsize=2, error_kw={"elinewidth": 0.8}
        )
        _label_bars(ax, y, part[value], part[high])
        ax.set_yticks(y, labels[key])
        ax.invert_yaxis()
        if key is not None:
            ax.set_title(" · ".join(map(str, np.atleast_1d(key))), loc="left")
        if log:
            ax.set_xscale("log")
            _plain_log_ticks(ax.xaxis, df[[low, value, high]].to_numpy())
        ax.margins(x=0.15)
    axes[-1, 0].set_xlabel(xlabel + (" (log scale)" if log else ""))
    fig.suptitle(f"{title}\n{hardware}")
    return fig


def timing_panels(
    parts: dict[str, pd.DataFrame], *, title: str, hardware: str, log: bool = True
):
    """:func:`timing_bars` of several frames as panels of one figure, stacked, each
    titled by its key (every variant of the book in one chart, a panel per workload).

    Returns:
        The matplotlib figure.
    """
    rows = [len(df) for df in parts.values()]
    fig, axes = plt.subplots(
        len(parts),
        1,
        figsize=(WIDTH + 1.0, 0.42 * sum(rows) + 1.0 * len(parts) + 1.0),
        gridspec_kw={"height_ratios": rows},
        squeeze=False,
        layout="constrained",
    )
    for ax, (name, df) in zip(axes[:, 0], parts.items(), strict=True):
        handles = _bars(ax, df, log)
        ax.set_title(name, loc="left", fontsize=10)
    fig.suptitle(_suptitle(pd.concat(parts.values()), title, hardware))
    # Right of the first panel, level with its top: a legend beside the panel's title
    # covers it where the variant names leave the axes narrow, and one at the figure's
    # foot sits a page away from the first panel.
    fig.legend(
        handles=handles, loc="outside right upper", ncol=1, frameon=False, fontsize=9
    )
    return fig


def scaling_plot(
    df: pd.DataFrame,
    *,
    x: str,
    y: str,
    by: str,
    title: str,
    hardware: str,
    ylabel: str,
    ax=None,
):
    """Log-log lines of ``y`` against ``x``, one line per value of ``by`` (on ``ax``, a
    panel of a larger figure, or a figure of its own).

    Returns:
        The matplotlib figure.
    """
    fig, ax = plt.subplots() if ax is None else (ax.figure, ax)
    for name, part in df.groupby(by, sort=False):
        ax.plot(part[x], part[y], marker="o", label=str(name))
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log_ticks(ax.xaxis, df[x])
    _plain_log_ticks(ax.yaxis, df[y])
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"{title}\n{hardware}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def timeline_plot(tl: pd.DataFrame, *, title: str, hardware: str):
    """Kernels and host waits of :func:`extkernels.profiling.timeline` as horizontal
    bars.

    Returns:
        The matplotlib figure.
    """
    lanes = list(dict.fromkeys(tl["lane"]))
    fig, ax = plt.subplots(figsize=(WIDTH, 0.6 * len(lanes) + 1.4))
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
    ax.set_title(f"{title}\n{hardware}")
    fig.tight_layout()
    return fig


def clouds_figure(workloads, *, points: int = 4000):
    """Each workload of :mod:`extkernels.clouds` as a 3-D scatter of its reference
    points (grey; at most ``points`` of them, the one farthest from the cloud's median
    always among them, and drawn larger when it lies far beyond the rest, so that a
    lone outlier shows) and queries (blue), a panel each,
    every panel's box in the proportions of what it shows (a slab stays thin; chapter
    14).

    Returns:
        The matplotlib figure.
    """
    cols = 4
    rows = (len(workloads) + cols - 1) // cols
    fig = plt.figure(figsize=(WIDTH, 1.6 * rows + 0.3))
    for i, w in enumerate(workloads):
        ax = fig.add_subplot(rows, cols, i + 1, projection="3d")
        every = w.p_ref.cpu().numpy()
        ref = every[:: max(1, len(every) // points)]
        reach = np.abs(every - np.median(every, axis=0)).max(axis=1)
        far = reach.argmax()
        query = w.p_query[:: max(1, len(w.p_query) // 500)].cpu().numpy()
        ax.scatter(*ref.T, s=0.5, c="0.4", alpha=0.5, linewidths=0)
        # a point far beyond the rest (ten times the 99th percentile) drawn larger
        lone = reach[far] > 10 * np.percentile(reach, 99)
        ax.scatter(*every[far], s=8 if lone else 0.5, c="0.2", linewidths=0)
        ax.scatter(*query.T, s=2, c="tab:blue", alpha=0.6, linewidths=0)
        span = np.ptp(np.vstack([ref, every[far : far + 1], query]), axis=0)
        ax.set_box_aspect(np.maximum(span, 0.03 * span.max()))
        ax.set_title(w.name, fontsize=9, pad=0)
        ax.set_axis_off()
    fig.subplots_adjust(left=0, right=1, bottom=0, top=0.92, wspace=0, hspace=0.1)
    return fig


def geometry_panels(times: pd.DataFrame, *, methods, hardware: str, cols: int = 2):
    """Milliseconds per search against the cloud's size, log-log: a panel per cloud, a
    line per method, medians of the runs with their min-max as a band (chapter 14;
    ``times`` indexed by geometry, n, method, as
    :func:`extkernels.experiments.geometry.table` makes it).

    Returns:
        The matplotlib figure.
    """
    names = list(dict.fromkeys(times.index.get_level_values("geometry")))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(
        rows, cols, figsize=(WIDTH, 1.9 * rows + 0.6), sharex=True, sharey=True
    )
    for ax, name in zip(axes.flat, names, strict=False):
        part = times.xs(name, level="geometry")
        for method in methods:
            if method not in part.index.get_level_values("method"):
                continue
            line = part.xs(method, level="method").sort_index()
            ax.plot(line.index, line["ms"], marker="o", ms=3, label=method)
            ax.fill_between(line.index, line["min"], line["max"], alpha=0.2)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(name)
        ax.grid(True, which="major", alpha=0.3)
    for ax in axes.flat[len(names) :]:
        ax.set_axis_off()
    for ax in axes[-1]:
        ax.set_xlabel("reference points")
    for ax in axes[:, 0]:
        ax.set_ylabel("ms per search")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, frameon=False)
    fig.suptitle(f"kNN search (k = 7, 27,000 queries), {hardware}")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig
