"""The measurements around the Warp radius operator (chapters 5 and 6): the host's time
per forward pass, the projector a chapter profiles, whether a function compiles to one
graph, and the numbers the chapters' prose quotes from their timing tables.

Each function returning numbers returns them by glue key, as plain Python numbers and
words, so a chapter glues them in one loop.
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import torch

from ..models import Projector, RadiusAggregation
from ..problem import Problem
from ..profiling import graphs_and_breaks, profile, top_kernels
from ..timing import make_forward, verdict

__all__ = [
    "FORWARD_VARIANTS",
    "TRAINING_VARIANTS",
    "forward_numbers",
    "host_profiles",
    "host_numbers",
    "warp_projector",
    "graphs_and_breaks",
    "training_numbers",
]

#: Chapter 5's variants, each with the name its glue keys carry.
FORWARD_VARIANTS = {
    "radius/torch": "eager",
    "radius/torch+compile": "compiled",
    "radius/warp": "warp_eager",
    "radius/warp+compile": "warp",
}

#: Chapter 6's variants, each with the name its glue keys carry.
TRAINING_VARIANTS = {
    "radius/warp": "eager",
    "radius/warp+compile": "adjoint",
    "radius/warp-manual+compile": "manual",
    "radius/warp-saved+compile": "saved",
    "radius/warp+reduce-overhead": "ro",
}


def forward_numbers(table: pd.DataFrame) -> dict[str, float | str]:
    """The numbers chapter 5's prose quotes from its timing table, by glue key.

    Args:
        table: from :func:`extkernels.benchmark.run_all` over :data:`FORWARD_VARIANTS`.

    Returns:
        each variant's forward milliseconds (``radius_<name>_fwd_ms``) and speedup
        (``radius_<name>_speedup``); how the compiled Warp projector compares with the
        eager one (``warp_compiled_vs_eager``, :func:`~extkernels.timing.verdict`); and
        the brute force's peak memory over the Warp projector's (``radius_mem_ratio``).
    """
    numbers: dict[str, float | str] = {}
    for name, key in FORWARD_VARIANTS.items():
        numbers[f"radius_{key}_fwd_ms"] = float(table.loc[name, "forward_ms"])
        numbers[f"radius_{key}_speedup"] = float(table.loc[name, "forward_speedup"])
    numbers["warp_compiled_vs_eager"] = verdict(
        table, "radius/warp+compile", "radius/warp", "forward"
    )
    peak = table["peak_mb"]
    numbers["radius_mem_ratio"] = float(peak["radius/torch"] / peak["radius/warp"])
    return numbers


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


def host_numbers(tables: dict[str, pd.DataFrame]) -> dict[str, float | int]:
    """The numbers chapter 5's prose quotes from :func:`host_profiles`, by glue key:
    the host's milliseconds per forward pass (``host_<title>_ms``) and the number of
    operators it spends them in (``host_<title>_ops``)."""
    numbers: dict[str, float | int] = {}
    for title, table in tables.items():
        numbers[f"host_{title}_ms"] = float(table["time (ms)"].sum())
        numbers[f"host_{title}_ops"] = len(table)
    return numbers


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


def training_numbers(table: pd.DataFrame) -> dict[str, float | str]:
    """The numbers chapter 6's prose quotes from its timing table, by glue key.

    Args:
        table: from :func:`extkernels.benchmark.run_all` over
            :data:`TRAINING_VARIANTS`.

    Returns:
        each variant's training-step milliseconds (``<name>_train_ms``), and how the
        compiled projector compares with the eager one, the hand-written backward with
        the adjoint, the hand-over through ``ctx`` with the pool, and
        ``reduce-overhead`` with the default mode (:func:`~extkernels.timing.verdict`).
    """
    numbers: dict[str, float | str] = {
        f"{key}_train_ms": float(table.loc[name, "train_ms"])
        for name, key in TRAINING_VARIANTS.items()
    }
    for key, a, b in [
        ("compiled_vs_eager", "radius/warp+compile", "radius/warp"),
        ("manual_vs_adjoint", "radius/warp-manual+compile", "radius/warp+compile"),
        ("saved_vs_pool", "radius/warp-saved+compile", "radius/warp+compile"),
        ("ro_vs_compiled", "radius/warp+reduce-overhead", "radius/warp+compile"),
    ]:
        numbers[key] = verdict(table, a, b, "train")
    return numbers
