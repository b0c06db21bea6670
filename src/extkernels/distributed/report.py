"""The scaling command's results as the chapter shows them (chapter 13).

``python -m extkernels.distributed bench --out FILE`` writes ``meta`` (hardware, date,
versions, command), ``runs`` (one row per configuration and launch) and ``profiles``.
:func:`load` reads it back as one table of medians and spreads over the launches
(:func:`~.bench.table`); :func:`strong`, :func:`speedups` and :func:`weak` lay it out
for the page, and :func:`pays_from` finds the cloud size from which several ranks beat
one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from ..plotting import scaling_plot
from ..timing import crossover
from .bench import table

__all__ = [
    "load",
    "frame",
    "label",
    "strong",
    "speedups",
    "weak",
    "pays_from",
    "scaling_panels",
    "communication",
    "parts",
    "headlines",
    "traffic",
]


def load(path: str | Path) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    """``(meta, table, profiles)`` of a file of the scaling command."""
    data = json.loads(Path(path).read_text())
    return data["meta"], frame(data["runs"]), pd.DataFrame(data["profiles"])


def frame(runs: list[dict]) -> pd.DataFrame:
    """Rows of the scaling command's launches as one table (:func:`~.bench.table`),
    each configuration named (:func:`label`)."""
    tab = table(runs)
    tab["config"] = [label(r.layout, r.world) for r in tab.itertuples()]
    return tab


def label(layout: str, world: int) -> str:
    """How a configuration is named on the page: ``one device``, ``queries x 2``..."""
    if layout == "single":
        return "one device"
    return f"{layout} x {world}"


def _cell(ms: float, lo: float, hi: float) -> str:
    return f"{ms:.3g} ({lo:.3g}–{hi:.3g})"


def _grid(tab: pd.DataFrame, values: pd.Series) -> pd.DataFrame:
    out = (
        tab.assign(value=values)
        .pivot(index=["workload", "n_ref"], columns="config", values="value")
        .rename_axis(index=["workload", "N"], columns=None)
    )
    order = ["one device"] + sorted(c for c in out if c != "one device")
    return out[[c for c in order if c in out]]


def strong(tab: pd.DataFrame, metric: str = "train") -> pd.DataFrame:
    """Milliseconds of every configuration, median (min–max) of the launches: a row per
    workload and cloud size, a column per configuration."""
    cells = [
        _cell(ms, lo, hi)
        for ms, lo, hi in zip(
            tab[f"{metric}_ms"], tab[f"{metric}_min"], tab[f"{metric}_max"], strict=True
        )
    ]
    return _grid(tab, pd.Series(cells, index=tab.index)).fillna("")


def speedups(tab: pd.DataFrame, metric: str = "train") -> pd.DataFrame:
    """Every configuration's speedup over ``one device`` (ratio of medians), a row per
    workload and cloud size."""
    ms = f"{metric}_ms"
    base = tab[tab["layout"] == "single"].set_index(["workload", "n_ref"])[ms]
    ratio = [
        base.get((w, n), math.nan) / t
        for w, n, t in zip(tab["workload"], tab["n_ref"], tab[ms], strict=True)
    ]
    return _grid(tab, pd.Series(ratio, index=tab.index)).round(2)


def weak(
    tab: pd.DataFrame, layout: str = "reference", metric: str = "train"
) -> pd.DataFrame:
    """Weak scaling of ``layout``: for each cloud size ``n`` timed on one rank, the
    times with ``w`` ranks and ``w * n`` points, and the efficiency ``t(1, n) / t(w, w
    * n)`` (1 is perfect)."""
    ms = f"{metric}_ms"
    mine = tab[tab["layout"] == layout].set_index(["workload", "world", "n_ref"])[ms]
    rows = []
    for (workload, world, n), t in mine.items():
        if world != 1:
            continue
        for w in sorted({w for _, w, _ in mine.index if w > 1}):
            key = (workload, w, n * w)
            if key in mine.index:
                rows.append(
                    {
                        "workload": workload,
                        "points per rank": n,
                        "ranks": w,
                        "one rank (ms)": round(t, 3),
                        "W ranks (ms)": round(mine[key], 3),
                        "efficiency": round(t / mine[key], 2),
                    }
                )
    return pd.DataFrame(rows)


def scaling_panels(tab: pd.DataFrame, *, hardware: str):
    """Chapter 13's figure: milliseconds of every configuration against the cloud's
    size, log-log, the forward pass and the training step (columns) of each workload
    (rows), one legend for all four panels.

    Returns:
        The matplotlib figure.
    """
    # drawn at the book's column width (about 7.5 inches at 100 dpi), so that the fonts
    # keep their size on the page
    fig, axes = plt.subplots(2, 2, figsize=(7.6, 7.8))
    named = tab.rename(columns={"n_ref": "points in the cloud, N"})
    for row, workload in zip(axes, ("knn", "radius"), strict=True):
        for ax, metric in zip(row, ("forward", "train"), strict=True):
            what = "training step" if metric == "train" else "forward pass"
            scaling_plot(
                named[named["workload"] == workload],
                x="points in the cloud, N",
                y=f"{metric}_ms",
                by="config",
                title=f"{'kNN' if workload == 'knn' else 'radius'}: {what}",
                hardware=hardware,
                ylabel=f"ms per {what}",
                ax=ax,
            )
            ax.get_legend().remove()
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def pays_from(tab: pd.DataFrame, config: str, metric: str = "train") -> dict:
    """Per workload, the smallest cloud from which ``config`` beats ``one device`` at
    every larger size measured, its slowest launch below one device's fastest (NaN
    when it never does)."""
    return {
        workload: crossover(
            part.assign(
                status="ok",
                backend=part["config"],
                min=part[f"{metric}_min"],
                max=part[f"{metric}_max"],
            ),
            config,
            "one device",
            "n_ref",
        )
        for workload, part in tab.groupby("workload", sort=False)
    }


def _configs(profiles: pd.DataFrame) -> list[str]:
    pairs = zip(profiles["layout"], profiles["world"], strict=True)
    return [label(layout, w) for layout, w in pairs]


def communication(profiles: pd.DataFrame) -> pd.DataFrame:
    """The profiled training steps: communication per step and its share of the
    device time (on rank 0)."""
    cols = ["workload", "config", "n_ref", "comm_ms", "total_ms", "comm_share"]
    out = profiles.assign(config=_configs(profiles))[cols]
    out["comm_share"] = (100 * out["comm_share"]).round(1)
    return out.rename(
        columns={
            "n_ref": "N",
            "comm_ms": "communication (ms)",
            "total_ms": "device time (ms)",
            "comm_share": "communication (%)",
        }
    ).round(3)


def parts(profiles: pd.DataFrame, workload: str) -> pd.DataFrame:
    """Where one profiled training step of ``workload`` spends its device time
    (:func:`~.bench.device_parts`), on one device and on rank 0 of each ``reference``
    layout: milliseconds per part, and for several ranks how many times less than one
    device (above the number of ranks: the part shrinks faster than the work is
    divided)."""
    mine = profiles[profiles["workload"] == workload]
    mine = mine.assign(ranked=mine["layout"] != "single")  # one device first
    mine = mine.sort_values(["world", "ranked"]).assign(config=_configs)
    ms = pd.DataFrame(dict(zip(mine["config"], mine["parts"], strict=True)))
    ms = ms.rename(index={"total": "the whole step"})
    out = ms.round(3).rename(columns=lambda c: f"{c} (ms)")
    for config, world in zip(mine["config"], mine["world"], strict=True):
        if world > 1:
            out[f"one device / {config}"] = (ms["one device"] / ms[config]).round(2)
    return out.rename_axis("part of the step")


_PART_KEYS = {
    "matrix products": "mm",
    "the book's kernels": "ours",
    "everything else": "rest",
    "the whole step": "step",
}


def headlines(tab: pd.DataFrame, profiles: pd.DataFrame) -> dict:
    """The numbers chapter 13's prose quotes, by name, for ``glue``: ``n_big`` and
    ``n_small`` (the largest and smallest clouds one device ran); every layout's
    speedup over one device at those sizes, ``{workload}_{metric}_{big|small}_{layout}
    _x{W}``; the weak-scaling efficiencies, ``{workload}_weak_{points per rank}_x{W}``;
    one device's milliseconds at ``n_small``, ``{workload}_{metric}_small_ms``, and
    how many times longer it takes on ``n_big`` points than on half as many,
    ``{workload}_{metric}_doubling``; the communication share of the profiled steps,
    ``{workload}_comm_pct_x{W}``; and how many times less each part of the step takes
    on a rank than on one device, ``{workload}_{mm|ours|rest|step}_x{W}``."""
    big = int(tab.loc[tab["layout"] == "single", "n_ref"].max())
    small = int(tab["n_ref"].min())
    out: dict = {"n_big": f"{big:,}", "n_small": f"{small:,}"}
    for metric in ("forward", "train"):
        s = speedups(tab, metric)
        for (workload, n), row in s.iterrows():
            size = {big: "big", small: "small"}.get(n)
            for config, value in row.dropna().items():
                if size and " x " in config and not config.endswith(" x 1"):
                    layout, w = config.split(" x ")
                    out[f"{workload}_{metric}_{size}_{layout}_x{w}"] = float(value)
    one = tab[tab["layout"] == "single"].set_index(["workload", "n_ref"])
    for workload in one.index.unique("workload"):
        for metric in ("forward", "train"):
            out[f"{workload}_{metric}_small_ms"] = float(
                one[f"{metric}_ms"][workload, small]
            )
            if (workload, big // 2) in one.index:
                ms = one[f"{metric}_ms"]
                out[f"{workload}_{metric}_doubling"] = float(
                    ms[workload, big] / ms[workload, big // 2]
                )
    for r in weak(tab).itertuples():
        out[f"{r.workload}_weak_{r[2]}_x{r.ranks}"] = float(r.efficiency)
    for workload in profiles["workload"].unique():
        mine = profiles[profiles["workload"] == workload]
        for r in mine.itertuples():
            if r.layout == "reference" and r.world > 1:
                out[f"{workload}_comm_pct_x{r.world}"] = 100 * float(r.comm_share)
        p = parts(profiles, workload)
        for column in p.columns:
            if column.startswith("one device / "):
                w = column.rsplit(" x ", 1)[1]
                for part, key in _PART_KEYS.items():
                    out[f"{workload}_{key}_x{w}"] = float(p.loc[part, column])
    return out


def traffic(m: int, k: int, f: int, world: int, params: int) -> pd.DataFrame:
    """What each layout moves between ranks in one training step, in KiB that a rank
    receives (float32 values, int64 indices; an all-reduce counted as DDP's ring moves
    it, ``2 (W - 1) / W`` times the gradients)."""
    chunk = -(-m // world)
    others = world - 1
    ring = 2 * others / world * params * 4
    rows = [
        ("queries", "DDP: all-reduce of the gradients", "both", ring),
        ("reference", "kNN candidates: all-gather", "kNN", others * m * k * 12),
        ("reference", "partial sums: reduce-scatter", "kNN", others * chunk * f * 4),
        (
            "reference",
            "partial sums: reduce-scatter",
            "radius",
            others * chunk * (f + 1) * 4,
        ),
        ("reference", "their gradient: all-gather", "kNN", others * chunk * f * 4),
        (
            "reference",
            "their gradient: all-gather",
            "radius",
            others * chunk * (f + 1) * 4,
        ),
        ("reference", "DDP: all-reduce of the gradients", "both", ring),
    ]
    out = pd.DataFrame(rows, columns=["layout", "exchange", "workload", "KiB"])
    out["KiB"] = (out["KiB"] / 1024).round(1)
    return out
