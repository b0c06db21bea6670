"""The measurements around the Warp radius operator (chapters 5 and 6): the host's time
per forward pass, the projector a chapter profiles, whether a function compiles to one
graph, and the numbers the chapters' prose quotes from their timing tables.

Each function returning numbers returns them by glue key, as plain Python numbers, so
a chapter glues them in one loop.
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import torch

from ..models import Projector, RadiusAggregation
from ..problem import Problem
from ..profiling import graphs_and_breaks, profile, top_kernels
from ..timing import make_forward

__all__ = [
    "forward_numbers",
    "host_profiles",
    "host_numbers",
    "warp_projector",
    "graphs_and_breaks",
    "training_numbers",
]


def forward_numbers(table: pd.DataFrame) -> dict[str, float]:
    """The numbers chapter 5's prose quotes from its timing table, by glue key.

    Args:
        table: from :func:`extkernels.benchmark.run_all` over ``radius/torch`` and
            ``radius/warp``, eager and compiled.

    Returns:
        the eager Warp projector's forward-pass speedup over the eager brute force
        (``radius_warp_eager_speedup``), and the brute force's peak memory over the
        Warp projector's (``radius_mem_ratio``).
    """
    peak = table["peak_mb"]
    return {
        "radius_warp_eager_speedup": float(table.loc["radius/warp", "forward_speedup"]),
        "radius_mem_ratio": float(peak["radius/torch"] / peak["radius/warp"]),
    }


def host_profiles(
    models: dict[str, Callable],
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    *,
    device: torch.device,
    n_iters: int = 20,
) -> dict[str, pd.DataFrame]:
    """The host's self time per operator of one forward pass (chapter 5), per model.

    Args:
        models: title -> a projector (eager or compiled), called as
            ``model(p_query, p_ref)`` under ``torch.no_grad()``.
        p_query: ``(M, 3)`` float32; p_ref: ``(N, 3)`` float32, on ``device``.
        n_iters: forward passes profiled per model.

    Returns:
        title -> :func:`~extkernels.profiling.top_kernels` ``(host=True)``, up to 100
        operators, milliseconds per forward pass.
    """
    tables = {}
    for title, model in models.items():
        forward = make_forward(model, p_query, p_ref)
        prof = profile(forward, device=device, n_iters=n_iters)
        tables[title] = top_kernels(prof, top=100, host=True)
    return tables


def host_numbers(tables: dict[str, pd.DataFrame]) -> dict[str, float]:
    """The numbers chapter 5's prose quotes from :func:`host_profiles`, by glue key:
    the host's milliseconds per forward pass (``host_<title>_ms``)."""
    return {
        f"host_{title}_ms": float(table["time (ms)"].sum())
        for title, table in tables.items()
    }


def warp_projector(prob: Problem, **options) -> Projector:
    """The radius projector with the warp backend (chapter 6), its weights seeded by
    ``prob.seed``, on ``prob.device``.

    Args:
        prob: the chapter's problem (radius, sigma, hidden width, seed, device).
        options: for the warp backend (``handover``, ``backward``).
    """
    torch.manual_seed(prob.seed)
    aggregation = RadiusAggregation(prob.radius, prob.sigma, backend="warp", **options)
    return Projector(aggregation, prob.hidden).to(prob.device)


def training_numbers(table: pd.DataFrame) -> dict[str, float]:
    """The numbers chapter 6's prose quotes from its timing table, by glue key.

    Args:
        table: from :func:`extkernels.benchmark.run_all` over ``radius/warp`` and
            ``radius/warp+compile``, among others.

    Returns:
        the training-step milliseconds of the eager projector (``eager_train_ms``) and
        of the compiled one with Warp's adjoint (``adjoint_train_ms``).
    """
    return {
        "eager_train_ms": float(table.loc["radius/warp", "train_ms"]),
        "adjoint_train_ms": float(table.loc["radius/warp+compile", "train_ms"]),
    }
