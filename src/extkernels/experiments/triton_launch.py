"""Calling Triton from PyTorch: the small experiments of chapter 8.

:func:`cudagraph_skips` counts how often inductor declines CUDA graphs for a function
compiled with ``mode="reduce-overhead"``; :func:`autotune_times` times the search with
and without Triton's autotuner. These need a CUDA GPU. :func:`generated_lines` reads
inductor's generated code.
"""

from collections.abc import Callable

import pandas as pd
import torch
from triton.testing import do_bench

from ..ops.triton import ops
from ..timing import against_goal, verdict

__all__ = [
    "target_quotes",
    "cudagraph_skips",
    "autotune_times",
    "autotune_quotes",
    "generated_lines",
]

#: Chapter 8's targets on the H200: forward and training milliseconds at most, and
#: the speedup over the compiled cuML projector with RMM (chapter 4) at least.
FORWARD_MS, TRAIN_MS, SPEEDUP = 1.0, 1.5, 8
#: The variant the speedups are taken over, and the Triton variants held to targets.
CUML = "knn/cuml-op+compile+rmm"
EAGER, COMPILED, GRAPHS = (
    "knn/triton",
    "knn/triton+compile",
    "knn/triton+reduce-overhead",
)


def _speedup_words(cuml: pd.Series, row: pd.Series, metric: str) -> str:
    if cuml[f"{metric}_min"] / row[f"{metric}_max"] >= SPEEDUP:
        return f"at least {SPEEDUP}× faster than cuML in every run"
    if cuml[f"{metric}_ms"] / row[f"{metric}_ms"] >= SPEEDUP:
        return f"{SPEEDUP}× faster than cuML by the medians only"
    return f"short of {SPEEDUP}× cuML's speed even by the medians"


def target_quotes(table: pd.DataFrame) -> dict[str, float | str]:
    """What chapter 8's prose says of ``knn/triton+reduce-overhead`` against its targets
    (:data:`FORWARD_MS`, :data:`TRAIN_MS`, :data:`SPEEDUP` over :data:`CUML`), from a
    timing table of the benchmark's runs: the verdicts (``fwd_goal``, ``train_goal``:
    the median and the time goal met in every run, in some runs only or in none, by
    :func:`~extkernels.timing.against_goal`, and the speedup in every run, by the
    medians only or not at all), the slowest forward run and the speedups, and the
    graphed step against the compiled one by the runs' ranges."""
    ro, cuml = table.loc[GRAPHS], table.loc[CUML]
    fwd = against_goal(table, GRAPHS, "forward", FORWARD_MS)
    train = against_goal(table, GRAPHS, "train", TRAIN_MS)
    return {
        "fwd_goal": f"{fwd} and {_speedup_words(cuml, ro, 'forward')}",
        "ro_fwd_max": float(ro["forward_max"]),
        "fwd_gain_min": float(cuml["forward_min"] / ro["forward_max"]),
        "train_goal": f"{train} and {_speedup_words(cuml, ro, 'train')}",
        "train_gain": float(cuml["train_ms"] / ro["train_ms"]),
        "train_gain_min": float(cuml["train_min"] / ro["train_max"]),
        "graphs_vs_compiled": verdict(table, GRAPHS, COMPILED, "train"),
    }


def cudagraph_skips(fn: Callable, *args, calls: int = 3) -> int:
    """How many times inductor skipped CUDA graphs while compiling ``fn`` with
    ``mode="reduce-overhead"`` and calling it ``calls`` times (0: every call replays a
    graph)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    for _ in range(calls):
        compiled(*args)
    return int(counters["inductor"]["cudagraph_skips"])


def autotune_times(p_query, p_ref, k: int, best, compiled: Callable) -> pd.Series:
    """Milliseconds per search by ``do_bench`` (chapter 8): the grid walk with the
    queries per program and warps fixed by hand, with those the autotuner chose
    (``best``, its ``best_config``), and ``compiled``, the autotuned search under
    ``torch.compile``, called as ``compiled(p_query, p_ref)``."""
    fixed = f"fixed (BLOCK_Q={ops.BLOCK_Q}, num_warps={ops.NUM_WARPS})"
    tuned = f"autotuned (BLOCK_Q={best.kwargs['BLOCK_Q']}, num_warps={best.num_warps})"
    times = {
        fixed: do_bench(lambda: ops.search(p_query, p_ref, k)),
        tuned: do_bench(lambda: ops.search(p_query, p_ref, k, autotuned=True)),
        "autotuned, compiled": do_bench(lambda: compiled(p_query, p_ref)),
    }
    return pd.Series(times, name="ms per search")


def autotune_quotes(tuned: pd.Series) -> dict[str, object]:
    """What chapter 8's prose says of :func:`autotune_times`'s table:
    ``autotune_vs_hand``, the autotuned configuration against the one fixed by hand
    (``"3.2 % faster than"``, ``"4.1 % slower than"``). One ``do_bench`` timing each, in
    one process: a difference, not a verdict."""
    fixed, tuned_ms = float(tuned.iloc[0]), float(tuned.iloc[1])
    gap = 100 * (fixed - tuned_ms) / fixed
    side = "faster" if gap > 0 else "slower"
    return {"autotune_vs_hand": f"{abs(gap):.1f} % {side} than"}


def generated_lines(
    compiled: Callable, *args, names: tuple[str, ...], call: str = "("
) -> tuple[object, list[str]]:
    """Calls ``compiled(*args)`` (a function under ``torch.compile``, not yet called
    with such arguments) and returns its result and the lines of the code inductor
    generated for it that name one of ``names`` and contain ``call``, stripped
    (chapter 8: where the generated code defines and launches our kernels)."""
    from torch._inductor.utils import run_and_get_code

    result, code = run_and_get_code(compiled, *args)
    lines = [
        line.strip()
        for line in "\n".join(code).splitlines()
        if any(name in line for name in names) and call in line
    ]
    return result, lines
