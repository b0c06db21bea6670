"""The experiments of chapter 9 around the C++ operators: the errors a bad input
raises, the float4 gather timed against the scalar one, the launches and kernels of a
profiled training step, and the numbers the chapter's prose quotes from its tables.

The measuring functions need a CUDA GPU; the ``*_quotes`` functions only read tables,
and return ``{glue key: value}`` for the chapter's hidden glue cells.
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import torch

from ..ops.checks import value_checks
from ..profiling import gpu_busy_fraction, profile, runtime_calls, timeline, top_kernels
from ..timing import ranked, verdict

__all__ = [
    "first_errors",
    "vector_loads",
    "launches",
    "step_kernels",
    "vector_load_quotes",
    "timing_quotes",
    "floor_quotes",
    "goal_quotes",
    "launch_quotes",
    "kernel_quotes",
]

#: The variants whose medians the prose quotes, by the prefix of their glue keys.
QUOTED = {
    "eager": "knn/cpp",
    "compiled": "knn/cpp+compile",
    "graphs": "knn/cpp+graphs",
    "ro": "knn/cpp+reduce-overhead",
    "triton_ro": "knn/triton+reduce-overhead",
}

#: The runtime calls that launch work on the GPU: a CUDA graph, or one kernel.
GRAPH_LAUNCHES = ("cudaGraphLaunch",)
KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel")


def first_errors(calls: dict[str, Callable[[], object]]) -> pd.DataFrame:
    """Each of ``calls`` run, and the error it raised (chapter 9): ``TypeError`` or
    ``ValueError`` and the first line of its message, ``"no error"`` for a call that
    raised none. Other exceptions propagate.

    Returns:
        DataFrame indexed by the calls' labels, one column ``error``.
    """
    errors = {}
    for label, call in calls.items():
        try:
            call()
        except (TypeError, ValueError) as e:
            errors[label] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        else:
            errors[label] = "no error"
    return pd.Series(errors, name="error").to_frame()


def vector_loads(p_query, p_ref, feats, k: int, sigma: float) -> pd.DataFrame:
    """The gather of chapter 9 with scalar and float4 loads at 32 float32 features, and
    the whole aggregation (search and gather) with ``feats`` ``(N, F)`` in float32 and
    float16 (converted in the timed call), each timed by ``triton.testing.do_bench``
    (CUDA only). Value checks are off, so that no call synchronises.

    Returns:
        DataFrame indexed by what was timed, one column ``ms (do_bench)``.
    """
    from triton.testing import do_bench  # Triton is optional; do_bench needs CUDA

    ops = torch.ops.extkernels_cpp
    f32 = torch.randn(p_ref.shape[0], 32, device=p_ref.device)
    with value_checks(False):
        _, w, i = ops.knn_aggregate_fwd(p_query, p_ref, f32, k, sigma)
        loads = {
            "gather, 32 features, scalar loads": do_bench(
                lambda: ops.gather(w, i, f32, False)
            ),
            "gather, 32 features, float4 loads": do_bench(
                lambda: ops.gather(w, i, f32, True)
            ),
            "search + gather, 25 features, float32": do_bench(
                lambda: ops.knn_aggregate_fwd(p_query, p_ref, feats, k, sigma)
            ),
            "search + gather, 25 features, float16": do_bench(
                lambda: ops.knn_aggregate_fwd(p_query, p_ref, feats.half(), k, sigma)
            ),
        }
    return pd.Series(loads, name="ms (do_bench)").to_frame()


def launches(step: Callable[[], object], device: torch.device) -> pd.DataFrame:
    """The CUDA graph launches and kernel launches of ``step`` per call, from
    ``torch.profiler`` over ten calls after five of warm-up, value checks off (chapter
    9's training step through ``mode="reduce-overhead"``).

    Returns:
        :func:`~extkernels.profiling.runtime_calls`'s table: ``name``, ``calls``, ``host
        time (ms)``.
    """
    with value_checks(False):
        prof = profile(step, device=device, n_iters=10, warmup=5)
    return runtime_calls(prof, names=GRAPH_LAUNCHES + KERNEL_LAUNCHES)


def step_kernels(
    step: Callable[[], object], device: torch.device
) -> tuple[pd.DataFrame, float]:
    """The device time of ``step`` (an eager training step, chapter 9) by operator,
    from ``torch.profiler`` over ten calls after three of warm-up, value checks off.

    Returns:
        ``(table, busy)``: :func:`~extkernels.profiling.top_kernels`'s table of up to
        100 operators (``name``, ``time (ms)``, ``share (%)``, ...), and the fraction of
        the profiled time the GPU was busy.
    """
    with value_checks(False):
        prof = profile(step, device=device, n_iters=10, warmup=3)
    return top_kernels(prof, top=100), gpu_busy_fraction(timeline(prof))


def vector_load_quotes(loads: pd.DataFrame) -> dict[str, float]:
    """``float4_gain``: how many times as fast as the scalar gather the float4 one ran,
    from :func:`vector_loads`'s table."""
    ms = loads["ms (do_bench)"]
    gain = (
        ms["gather, 32 features, scalar loads"]
        / ms["gather, 32 features, float4 loads"]
    )
    return {"float4_gain": float(gain)}


def timing_quotes(table: pd.DataFrame) -> dict[str, float | str]:
    """The medians the prose quotes from chapter 9's benchmark table (from
    :func:`~extkernels.benchmark.run_all`): ``<prefix>_fwd_ms`` and
    ``<prefix>_train_ms`` for each variant of :data:`QUOTED`, and
    ``compiled_vs_eager_forward`` / ``_train``, the compiled projector against the eager
    one in words (:func:`~extkernels.timing.verdict`), and ``triton_vs_cpp_ro_train``,
    chapter 8's Triton projector against this one, both through
    ``mode="reduce-overhead"``."""
    out: dict[str, float | str] = {}
    for prefix, name in QUOTED.items():
        out[f"{prefix}_fwd_ms"] = float(table.loc[name, "forward_ms"])
        out[f"{prefix}_train_ms"] = float(table.loc[name, "train_ms"])
    for metric in ("forward", "train"):
        out[f"compiled_vs_eager_{metric}"] = verdict(
            table, "knn/cpp+compile", "knn/cpp", metric
        )
    out["triton_vs_cpp_ro_train"] = verdict(
        table, QUOTED["triton_ro"], QUOTED["ro"], "train"
    )
    return out


def floor_quotes(shares: pd.DataFrame, goals: tuple[float, float]) -> dict:
    """The floor and the aggregation's share in prose (chapter 9), from
    :func:`~extkernels.timing.above_floor`'s table with the labels ``"eager"`` and
    ``"one CUDA graph"``: ``floor_<how>_<metric>_ms`` and ``agg_<how>_<metric>_ms``
    (``how`` is ``eager`` or ``graphs``, ``metric`` ``forward`` or ``training``), and
    ``floor_vs_<metric>_goal``, how far the eager floor lies above or under ``goals``
    (forward ms, training ms)."""
    out: dict[str, float | str] = {}
    for (how, metric), row in shares.iterrows():
        key = f"{'eager' if how == 'eager' else 'graphs'}_{metric}"
        out[f"floor_{key}_ms"] = float(row["floor ms"])
        out[f"agg_{key}_ms"] = float(row["aggregation ms"])
    for metric, goal in zip(("forward", "training"), goals, strict=True):
        floor = shares.loc[("eager", metric), "floor ms"]
        out[f"floor_vs_{metric}_goal"] = (
            f"{floor - goal:.3f} ms above the {goal:.2f} ms goal"
            if floor > goal
            else f"{goal - floor:.3f} ms under the {goal:.2f} ms goal"
        )
    return out


def goal_quotes(
    targets: pd.DataFrame, table: pd.DataFrame, pairs: dict[str, tuple[str, str]]
) -> dict[str, str]:
    """The verdicts chapter 9's prose reads, in words. ``eager_goals`` and
    ``graphs_goals``: how the eager projector and the one in a CUDA graph fare against
    their two goals, from :func:`~extkernels.timing.against_goals` (``"meets both"``,
    ``"misses both"``, or which one it meets). And for each label of
    ``pairs`` (``label -> (variant, floor variant)``, as for
    :func:`~extkernels.timing.above_floor`) and each metric,
    ``spread_<how>_<metric>`` (``how`` is ``eager`` or ``graphs``, ``metric``
    ``forward`` or ``training``): whether the two variants' min–max ranges over the
    runs lie apart, so that the difference of their medians is measured, or overlap,
    so that it is within the spread."""
    out = {}
    for prefix in ("eager", "graphs"):
        if QUOTED[prefix] not in targets.index:
            continue
        row = targets.loc[QUOTED[prefix]]
        fwd = row["forward ms"] <= row["forward goal"]
        train = row["training ms"] <= row["training goal"]
        out[f"{prefix}_goals"] = {
            (True, True): "meets both",
            (False, False): "misses both",
            (True, False): "meets the forward goal and misses the training one",
            (False, True): "misses the forward goal and meets the training one",
        }[bool(fwd), bool(train)]
    for label, (name, floor) in pairs.items():
        how = "eager" if label == "eager" else "graphs"
        for metric, key in (("forward", "forward"), ("training", "train")):
            apart = ranked(
                (table.loc[name, f"{key}_min"], table.loc[name, f"{key}_max"]),
                (table.loc[floor, f"{key}_min"], table.loc[floor, f"{key}_max"]),
                same="overlap",
            )
            out[f"spread_{how}_{metric}"] = (
                "their min–max ranges lie apart, so the difference is measured"
                if apart != "overlap"
                else "their min–max ranges overlap, so the difference is within the"
                " run-to-run spread and only approximate"
            )
    return out


def launch_quotes(table: pd.DataFrame) -> dict[str, float]:
    """``ro_graph_launches`` and ``ro_kernel_launches`` per step, from
    :func:`launches`'s table (chapter 9)."""
    out = {}
    for label, prefix in (("graph", GRAPH_LAUNCHES), ("kernel", KERNEL_LAUNCHES)):
        calls = table.loc[table["name"].str.startswith(prefix), "calls"].sum()
        out[f"ro_{label}_launches"] = float(calls)
    return out


def kernel_quotes(table: pd.DataFrame, busy: float) -> dict[str, float]:
    """From :func:`step_kernels` (chapter 9): ``gpu_step_ms``, the device time of a
    step; ``gpu_busy_pct``, the GPU's busy share of the profiled time; and
    ``mm_share_pct``, the share of the matrix products (``aten::mm``,
    ``aten::addmm``)."""
    matmuls = table["name"].isin(["aten::mm", "aten::addmm"])
    return {
        "gpu_step_ms": float(table["time (ms)"].sum()),
        "gpu_busy_pct": float(100 * busy),
        "mm_share_pct": float(table.loc[matmuls, "share (%)"].sum()),
    }
