"""What chapter 11 reports from its tables: the rows of the benchmark's table it shows,
and the numbers its prose quotes from the tables of :mod:`~.whole_step`.

Every ``*_quotes`` function only reads a table and returns ``{glue key: value}``
(floats, or words for prose) for the chapter's hidden glue cells; the keys are the ones
the chapter's markdown names.
"""

from __future__ import annotations

import pandas as pd

from ..timing import ranked, verdict, within_goal

__all__ = [
    "BENCHMARK_ROWS",
    "benchmark_rows",
    "benchmark_quotes",
    "lanes_quotes",
    "radius_quotes",
    "replay_quotes",
    "reduce_overhead_quotes",
    "shapes_quotes",
    "rounding_quotes",
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

#: The benchmark rows whose medians the prose quotes beside the goals' rows.
QUOTED_ROWS = ("knn/floor+graphs", "radius/floor+graphs", "radius/warp+graphs")

#: The kernels of a replay that are cuBLAS's matrix products, by their names' parts.
GEMM_KERNELS = "gemm|Kernel2|splitK|gemv"


def _key(variant: str) -> str:
    return variant.replace("/", "_").replace("+", "_").replace("-", "_")


def benchmark_rows(bench: pd.DataFrame) -> pd.DataFrame:
    """The rows of :data:`BENCHMARK_ROWS` that ``bench`` (a benchmark table,
    :func:`~extkernels.results.load`) holds, in that order (chapter 11)."""
    return bench.loc[[n for n in BENCHMARK_ROWS if n in bench.index]]


def benchmark_quotes(bench: pd.DataFrame, goals: dict) -> dict[str, float]:
    """``<variant>_fwd`` and ``<variant>_train`` (``/``, ``+`` and ``-`` of the name
    made ``_``), the medians of ``bench`` for every variant of ``goals`` and of
    :data:`QUOTED_ROWS` that it holds; ``<variant>_outcome``, which of its ``goals``
    (forward ms, training ms) a variant meets, in words; and
    ``<workload>_compile_in_graph_train``, the compiled model's training step in one
    graph against the eager model's (:func:`~extkernels.timing.verdict`);
    ``<workload>_one_graph_settings_fwd`` and ``_train``, the compiled model in one
    graph with :data:`~extkernels.variants.IN_ONE_GRAPH` against inductor's defaults
    (chapter 11)."""
    out = {}
    for name in [*goals, *QUOTED_ROWS]:
        if name in bench.index:
            out[f"{_key(name)}_fwd"] = float(bench.loc[name, "forward_ms"])
            out[f"{_key(name)}_train"] = float(bench.loc[name, "train_ms"])
    for name, (fwd, train) in goals.items():
        if name in bench.index:
            row = bench.loc[name]
            out[f"{_key(name)}_outcome"] = _outcome(
                within_goal(row, "forward", fwd), within_goal(row, "train", train)
            )
    for workload in ("knn", "radius"):
        pair = [f"{workload}/fused+compile+graphs", f"{workload}/fused+graphs"]
        if all(n in bench.index for n in pair) and "train_min" in bench:
            out[f"{workload}_compile_in_graph_train"] = verdict(bench, *pair, "train")
        pair = [pair[0], f"{pair[0]}+inductor-defaults"]
        if all(n in bench.index for n in pair) and "train_min" in bench:
            for metric, short in (("forward", "fwd"), ("train", "train")):
                key = f"{workload}_one_graph_settings_{short}"
                out[key] = verdict(bench, *pair, metric)
    return out


def _outcome(forward: bool | None, train: bool | None) -> str:
    if forward is True and train is True:
        return "meets both targets"
    if forward is False and train is False:
        return "misses both targets"
    verb = {True: "meets", None: "has runs on both sides of", False: "misses"}
    rank = {True: 0, None: 1, False: 2}
    parts = {"forward": forward, "training": train}
    a, b = sorted(parts, key=lambda m: rank[parts[m]])
    return f"{verb[parts[a]]} the {a} target and {verb[parts[b]]} the {b} one"


def lanes_quotes(lanes: pd.DataFrame) -> dict[str, float | str]:
    """From :func:`~.whole_step.lanes_table` (chapter 11): ``best_lanes``, the fastest
    group size, and its ``best_lanes_ms``; ``one_lane_ms``; ``cpp_agg_ms``, chapter 9's
    operator; and ``lanes_vs_cpp``, the best group against chapter 9 in words."""
    best = lanes.drop("chapter 9")["ms"].astype(float).idxmin()
    return {
        "best_lanes": best,
        "best_lanes_ms": float(lanes.loc[best, "ms"]),
        "one_lane_ms": float(lanes.loc["1", "ms"]),
        "cpp_agg_ms": float(lanes.loc["chapter 9", "ms"]),
        "lanes_vs_cpp": ranked(
            tuple(lanes.loc[best, ["min", "max"]]),
            tuple(lanes.loc["chapter 9", ["min", "max"]]),
            same="within the spread of",
        ),
    }


def radius_quotes(walks: pd.DataFrame) -> dict[str, float]:
    """From :func:`~.whole_step.radius_kernels` (chapter 11): ``warp_gain_fwd`` and
    ``warp_gain_bwd``, how many times as fast as the second kernel (a thread per
    feature) the first (a warp per query) runs."""
    return {
        f"warp_gain_{short}": float(walks[column].iloc[1] / walks[column].iloc[0])
        for short, column in (("fwd", "forward ms"), ("bwd", "backward ms"))
    }


def replay_quotes(steps: pd.DataFrame, kernels: dict) -> dict[str, float | str]:
    """From :func:`~.whole_step.captured_steps` of each workload (chapter 11):
    ``steps`` indexed by (workload, model in the graph), ``kernels`` the replay's
    kernels by workload. For each workload: ``<w>_compiled_graph_train``, the step
    with the compiled model inside; ``<w>_compiled_vs_eager_graph``, that step against
    the eager model's in words; ``<w>_gemm_share`` and ``<w>_agg_share``, the shares
    (%) of cuBLAS's kernels and of the backend's in a replay."""
    out: dict[str, float | str] = {}
    for workload, table in kernels.items():
        compiled = steps.loc[(workload, "compiled")]
        eager = steps.loc[(workload, "eager")]
        out[f"{workload}_compiled_graph_train"] = float(compiled["ms"])
        out[f"{workload}_compiled_vs_eager_graph"] = ranked(
            (compiled["min"], compiled["max"]),
            (eager["min"], eager["max"]),
            same="within the spread of",
        )
        gemm = table["kernel"].str.contains(GEMM_KERNELS)
        out[f"{workload}_gemm_share"] = float(table.loc[gemm, "share (%)"].sum())
        agg = table["kernel"].str.contains("extkernels")
        out[f"{workload}_agg_share"] = float(table.loc[agg, "share (%)"].sum())
    return out


def reduce_overhead_quotes(
    ro: pd.DataFrame, by_hand: dict | None = None
) -> dict[str, float]:
    """From the rows of :func:`~.whole_step.reduce_overhead_row` by workload (chapter
    11): ``ro_whole_knn_ms``, ``ro_whole_radius_ms`` and ``ro_whole_graphs``, the
    graph launches of a kNN step; given ``by_hand`` (:func:`replay_quotes`), also
    ``ro_over_by_hand_<workload>``, the step's time over the compiled step captured in
    one graph by hand."""
    out = {
        "ro_whole_knn_ms": float(ro.loc["knn", "ms per step"]),
        "ro_whole_radius_ms": float(ro.loc["radius", "ms per step"]),
        "ro_whole_graphs": float(ro.loc["knn", "graph launches"]),
    }
    for workload in ("knn", "radius") if by_hand else ():
        hand = by_hand[f"{workload}_compiled_graph_train"]
        out[f"ro_over_by_hand_{workload}"] = out[f"ro_whole_{workload}_ms"] / hand
    return out


def shapes_quotes(shapes: pd.DataFrame) -> dict[str, float]:
    """From :func:`~.whole_step.changing_shapes` (chapter 11), at the first call and at
    the second, whose size differs from the first's: ``recompile_ms`` (the compiled
    model's first call at the new size), ``static_ms`` (its calls at the first size),
    ``dynamic_ms`` (``mark_dynamic`` at the new size), ``recapture_ms`` and
    ``graph_ms`` (a graph per size: its capture and its replays at the new size), and
    ``bucket_ms`` (the padded bucket's replays at the new size)."""
    bucket = next(
        s
        for s in shapes.index.get_level_values("strategy")
        if s.startswith("one graph, padded")
    )

    def at(strategy: str, call: int, column: str) -> float:
        return float(
            shapes.xs((strategy, call), level=("strategy", "call"))[column].iloc[0]
        )

    return {
        "recapture_ms": at("one graph per size", 2, "first call ms"),
        "graph_ms": at("one graph per size", 2, "ms per call"),
        "bucket_ms": at(bucket, 2, "ms per call"),
        "recompile_ms": at("compiled", 2, "first call ms"),
        "dynamic_ms": at("compiled, mark_dynamic", 2, "ms per call"),
        "static_ms": at("compiled", 1, "ms per call"),
    }


def rounding_quotes(rounding: pd.DataFrame) -> dict[str, float]:
    """From :func:`~.whole_step.rounded_search` (chapter 11): ``same_f16`` and
    ``same_bf16``, the share (%) of queries that keep their neighbours."""
    same = rounding["same neighbours (%)"]
    return {"same_f16": float(same["float16"]), "same_bf16": float(same["bfloat16"])}


def half_quotes(half: pd.DataFrame, *, speed: bool) -> dict[str, float]:
    """From :func:`~.whole_step.half_features` (chapter 11): ``half_error``, float16's
    relative error, and with ``speed`` (timings worth quoting: on a GPU)
    ``half_speed``, how many times as fast as float32 features float16 ones run."""
    out = {"half_error": float(half.loc["float16", "relative error"])}
    if speed:
        out["half_speed"] = float(half.loc["float32", "ms"] / half.loc["float16", "ms"])
    return out
