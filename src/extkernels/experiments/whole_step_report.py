"""What chapter 11 reports from its tables: the rows of the benchmark's table it shows,
and the numbers its prose quotes from the tables of :mod:`~.whole_step`.

Every ``*_quotes`` function only reads a table and returns ``{glue key: value}``
(numbers, or the name of a row) for the chapter's hidden glue cells; the keys are the
ones the chapter's markdown names.
"""

from __future__ import annotations

import pandas as pd

__all__ = [
    "BENCHMARK_ROWS",
    "benchmark_rows",
    "benchmark_quotes",
    "lanes_quotes",
    "radius_quotes",
    "replay_quotes",
    "reduce_overhead_quotes",
    "shapes_quotes",
    "half_quotes",
]

#: The rows of the benchmark's table that chapter 11 shows, in its order.
BENCHMARK_ROWS = [
    f"{workload}/{variant}"
    for workload, first in (("knn", "cpp+graphs"), ("radius", "warp+graphs"))
    for variant in (
        first,
        "fused",
        "fused+reduce-overhead",
        "fused+graphs",
        "fused+compile+graphs",
        "fused+compile+graphs+inductor-defaults",
        "floor+graphs",
    )
]


def _key(variant: str) -> str:
    return variant.replace("/", "_").replace("+", "_").replace("-", "_")


def benchmark_rows(bench: pd.DataFrame) -> pd.DataFrame:
    """The rows of :data:`BENCHMARK_ROWS` that ``bench`` (a benchmark table,
    :func:`~extkernels.results.load`) holds, in that order (chapter 11)."""
    return bench.loc[[n for n in BENCHMARK_ROWS if n in bench.index]]


def benchmark_quotes(bench: pd.DataFrame, names) -> dict[str, float]:
    """``<variant>_fwd`` and ``<variant>_train`` (``/``, ``+`` and ``-`` of the name
    made ``_``), the medians of ``bench`` for every variant of ``names`` that it holds
    (chapter 11)."""
    out = {}
    for name in names:
        if name in bench.index:
            out[f"{_key(name)}_fwd"] = float(bench.loc[name, "forward_ms"])
            out[f"{_key(name)}_train"] = float(bench.loc[name, "train_ms"])
    return out


def lanes_quotes(lanes: pd.DataFrame) -> dict[str, float | str]:
    """From :func:`~.whole_step.lanes_table` (chapter 11): ``best_lanes``, the fastest
    group size, and its ``best_lanes_ms``; ``cpp_agg_ms``, chapter 9's operator."""
    best = lanes.drop("chapter 9")["ms"].astype(float).idxmin()
    return {
        "best_lanes": best,
        "best_lanes_ms": float(lanes.loc[best, "ms"]),
        "cpp_agg_ms": float(lanes.loc["chapter 9", "ms"]),
    }


def radius_quotes(walks: pd.DataFrame) -> dict[str, float]:
    """From :func:`~.whole_step.radius_kernels` (chapter 11): ``warp_gain_bwd``, how
    many times as fast as the second kernel (a thread per feature) the first (a warp
    per query) runs the backward."""
    return {
        "warp_gain_bwd": float(
            walks["backward ms"].iloc[1] / walks["backward ms"].iloc[0]
        )
    }


def replay_quotes(steps: pd.DataFrame, kernels: dict) -> dict[str, float]:
    """From :func:`~.whole_step.captured_steps` of each workload (chapter 11):
    ``kernels`` the replay's kernels by workload. For each workload ``<w>_agg_share``,
    the share (%) of the backend's kernels in a replay."""
    out: dict[str, float] = {}
    for workload, table in kernels.items():
        agg = table["kernel"].str.contains("extkernels")
        out[f"{workload}_agg_share"] = float(table.loc[agg, "share (%)"].sum())
    return out


def reduce_overhead_quotes(
    ro: pd.DataFrame, steps: pd.DataFrame | None = None
) -> dict[str, float]:
    """From the rows of :func:`~.whole_step.reduce_overhead_row` by workload (chapter
    11): ``ro_whole_graphs``, the graph launches of a kNN step; given ``steps``
    (:func:`~.whole_step.captured_steps` of each workload, indexed by (workload, model
    in the graph)), also ``ro_over_by_hand_<workload>``, the step's time over the
    compiled step captured in one graph by hand."""
    out = {"ro_whole_graphs": float(ro.loc["knn", "graph launches"])}
    for workload in ("knn", "radius") if steps is not None else ():
        hand = float(steps.loc[(workload, "compiled"), "ms"])
        out[f"ro_over_by_hand_{workload}"] = (
            float(ro.loc[workload, "ms per step"]) / hand
        )
    return out


def shapes_quotes(shapes: pd.DataFrame) -> dict[str, float]:
    """From :func:`~.whole_step.changing_shapes` (chapter 11): ``recapture_ms``, the
    capture of a graph per size at the second call, whose size differs from the
    first's."""
    at = shapes.xs(("one graph per size", 2), level=("strategy", "call"))
    return {"recapture_ms": float(at["first call ms"].iloc[0])}


def half_quotes(half: pd.DataFrame) -> dict[str, float]:
    """From :func:`~.whole_step.half_features` (chapter 11): ``half_error``, float16's
    relative error."""
    return {"half_error": float(half.loc["float16", "relative error"])}
