"""Calling Triton from PyTorch: the small experiments of chapter 8.

:func:`launch_costs` times, per call, each layer between a Python caller and the
search kernel (the kernel launched directly, through ``wrap_triton``, the launcher that
builds the grid, the ``triton_op``); :func:`cudagraph_skips` counts how often
inductor declines CUDA graphs for a function compiled with ``mode="reduce-overhead"``.
Both need a CUDA GPU.
"""

from collections.abc import Callable

import torch
import triton
from torch.library import wrap_triton

from ..ops.checks import value_checks
from ..ops.triton import ops
from ..ops.triton.kernels import knn_kernel
from ..timing import time_fn

__all__ = ["launch_costs", "cudagraph_skips"]


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
        "launcher: grid build + kernel": lambda: ops._launch(p_query, p_ref, k),
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
