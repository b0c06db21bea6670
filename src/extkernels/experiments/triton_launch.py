"""Calling Triton from PyTorch: the small experiments of chapter 8.

:func:`launch_costs` times, per call, each layer between a Python caller and the
search kernel (the kernel launched directly, through ``wrap_triton``, the launcher that
builds the grid, the ``triton_op``); :func:`cudagraph_skips` counts how often
inductor declines CUDA graphs for a function compiled with ``mode="reduce-overhead"``;
:func:`autotune_times` times the search with and without Triton's autotuner. These need
a CUDA GPU. :func:`generated_lines` reads inductor's generated code,
:func:`against_targets` and :func:`targets_glue` set the timings beside the chapter's
targets.
"""

from collections.abc import Callable

import pandas as pd
import torch
import triton
from torch.library import wrap_triton
from triton.testing import do_bench

from ..ops.checks import value_checks
from ..ops.triton import ops
from ..ops.triton.kernels import knn_kernel
from ..timing import time_fn, verdict

__all__ = [
    "launch_costs",
    "cudagraph_skips",
    "autotune_times",
    "autotune_quotes",
    "generated_lines",
    "against_targets",
    "targets_glue",
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


def launch_costs(p_query, p_ref, k: int, n_iters: int = 500) -> dict[str, float]:
    """Microseconds per call of the brute-force search launched four ways, and of one
    small PyTorch operation for scale, at a size where launching costs more than the
    kernel runs (value checks off, as in the timed iterations)."""
    m, n = p_query.shape[0], p_ref.shape[0]
    distances = p_query.new_empty((m, k))
    indices = p_query.new_empty((m, k), dtype=torch.int64)
    clouds, cells_args = ops._search_args(p_query, p_ref, grid=False, cells=None)
    args = (*clouds, distances, indices, m, n, *cells_args)
    meta = dict(
        K=k,
        KP=triton.next_power_of_2(k),
        BLOCK_Q=ops.BLOCK_Q,
        BLOCK_R=ops.BLOCK_R,
        GRID=False,
        num_warps=ops.NUM_WARPS,
    )
    grid = (triton.cdiv(m, ops.BLOCK_Q),)
    ways: dict[str, Callable[[], object]] = {
        "kernel[grid](...)": lambda: knn_kernel[grid](*args, **meta),
        "wrap_triton(kernel)[grid](...)": lambda: wrap_triton(knn_kernel)[grid](
            *args, **meta
        ),
        "launcher: grid build + kernel": lambda: ops.launch_knn(p_query, p_ref, k),
        "triton_op: checks + launcher": lambda: torch.ops.triton_knn.knn(
            p_query, p_ref, k
        ),
        "for scale: torch.add": lambda: torch.add(p_query, 1.0),
    }
    with value_checks(False):
        return {name: time_fn(fn, n_iters) * 1e3 for name, fn in ways.items()}


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


def against_targets(table: pd.DataFrame) -> pd.DataFrame:
    """The Triton variants of ``table`` (from :func:`extkernels.benchmark.run_all`)
    beside chapter 8's targets: median forward and training ms, the speedups over the
    cuML variant, and whether all four targets are met."""
    cuml = table.loc[CUML]
    rows = {}
    for name in (EAGER, COMPILED, GRAPHS):
        row = table.loc[name]
        rows[name] = {
            f"forward ms (≤ {FORWARD_MS})": row["forward_ms"],
            f"training ms (≤ {TRAIN_MS})": row["train_ms"],
            f"× cuML forward (≥ {SPEEDUP})": cuml["forward_ms"] / row["forward_ms"],
            f"× cuML training (≥ {SPEEDUP})": cuml["train_ms"] / row["train_ms"],
        }
    targets = pd.DataFrame(rows).T
    targets["all met"] = (
        (targets.iloc[:, 0] <= FORWARD_MS)
        & (targets.iloc[:, 1] <= TRAIN_MS)
        & (targets.iloc[:, 2] >= SPEEDUP)
        & (targets.iloc[:, 3] >= SPEEDUP)
    )
    return targets


def targets_glue(table: pd.DataFrame, targets: pd.DataFrame) -> dict[str, object]:
    """The numbers and words chapter 8's prose quotes about its timings, by glue key:
    from ``table`` (:func:`extkernels.benchmark.run_all`) and ``targets``
    (:func:`against_targets`); plain floats and strings."""
    ro, eager, compiled = table.loc[GRAPHS], table.loc[EAGER], table.loc[COMPILED]
    cuml = table.loc[CUML]
    out: dict[str, object] = {
        "ro_fwd_ms": float(ro["forward_ms"]),
        "ro_train_ms": float(ro["train_ms"]),
        "eager_fwd_ms": float(eager["forward_ms"]),
        "eager_train_ms": float(eager["train_ms"]),
        "cuml_fwd_ms": float(cuml["forward_ms"]),
        "cuml_train_ms": float(cuml["train_ms"]),
        "ro_vs_cuml_fwd": float(cuml["forward_ms"] / ro["forward_ms"]),
        "ro_vs_cuml_train": float(cuml["train_ms"] / ro["train_ms"]),
        "ro_gain_train": float(compiled["train_ms"] / ro["train_ms"]),
        "ro_vs_compiled": verdict(table, GRAPHS, COMPILED, "train"),
        "ro_targets": (
            "meets every target"
            if targets.loc[GRAPHS, "all met"]
            else "misses a target"
        ),
    }
    for name, key in [(EAGER, "eager"), (COMPILED, "compiled")]:
        within = targets.loc[name, f"training ms (≤ {TRAIN_MS})"] <= TRAIN_MS
        out[f"{key}_train_target"] = "meets" if within else "misses"
    row = targets.loc[GRAPHS]
    fwd = [row.iloc[0] <= FORWARD_MS, row.iloc[2] >= SPEEDUP]
    train = [row.iloc[1] <= TRAIN_MS, row.iloc[3] >= SPEEDUP]
    out["ro_fwd_targets"], out["ro_train_targets"] = _met(fwd), _met(train)
    out["ro_train_max"] = float(ro["train_max"])
    return out


def _met(met: list[bool]) -> str:
    """Two targets' outcome in words."""
    return {2: "meets both", 1: "meets one of", 0: "misses both"}[sum(map(bool, met))]
