"""Calling Triton from PyTorch: the small experiments of chapter 8.

:func:`timing_quotes` reads the numbers the chapter's prose quotes from the
benchmark's table. :func:`cudagraph_skips` counts how often inductor declines CUDA
graphs for a function compiled with ``mode="reduce-overhead"``; :func:`autotune_times`
times the search with and without Triton's autotuner. These two need a CUDA GPU.
:func:`generated_lines` reads inductor's generated code.
"""

from collections.abc import Callable

import pandas as pd
import torch
from triton.testing import do_bench

from ..ops.triton import ops
from ..profiling import compiler_count, reset_compiler

__all__ = [
    "timing_quotes",
    "cudagraph_skips",
    "autotune_times",
    "generated_lines",
]

#: The variant the gains are taken over, and the Triton variant the prose quotes.
CUML = "knn/cuml-op+compile+rmm"
GRAPHS = "knn/triton+reduce-overhead"


def timing_quotes(table: pd.DataFrame) -> dict[str, float]:
    """The numbers chapter 8's prose quotes of ``knn/triton+reduce-overhead`` from a
    timing table of the benchmark's runs: ``ro_fwd_max``, its slowest forward run;
    ``fwd_gain_min``, :data:`CUML`'s fastest forward run over that slowest one; and
    ``train_gain``, the ratio of the training steps' medians."""
    ro, cuml = table.loc[GRAPHS], table.loc[CUML]
    return {
        "ro_fwd_max": float(ro["forward_max"]),
        "fwd_gain_min": float(cuml["forward_min"] / ro["forward_max"]),
        "train_gain": float(cuml["train_ms"] / ro["train_ms"]),
    }


def cudagraph_skips(fn: Callable, *args, calls: int = 3) -> int:
    """How many times inductor skipped CUDA graphs while compiling ``fn`` with
    ``mode="reduce-overhead"`` and calling it ``calls`` times (0: every call replays a
    graph)."""
    reset_compiler()
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    for _ in range(calls):
        compiled(*args)
    return compiler_count("inductor", "cudagraph_skips")


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
