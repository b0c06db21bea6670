"""Chapter 3's measurements of cuML's search: how many queries get a wrong set of
neighbours, how long each of cuML's exact searches takes, and the numbers the chapter's
prose quotes from its timing table.
"""

from __future__ import annotations

import pandas as pd
import torch

from .. import ops
from ..ops.cuml import ALGORITHMS
from ..timing import time_fn

__all__ = ["compare_searches", "timing_numbers", "wrong_pct", "wrong_sets"]


def wrong_sets(indices: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Which queries' sets of neighbours differ from the exact ones (order within a
    row does not count).

    Args:
        indices: ``(M, k)`` integer neighbour indices found.
        exact: ``(M, k)`` integer indices of the exact neighbours.

    Returns:
        ``(M,)`` bool, true where the two sets differ.
    """
    if indices.shape != exact.shape:
        raise ValueError(
            f"indices: expected the shape of exact, {tuple(exact.shape)}, got "
            f"{tuple(indices.shape)}"
        )
    found = indices.sort(dim=1).values
    return (found != exact.to(found.dtype).sort(dim=1).values).any(dim=1)


def wrong_pct(indices: torch.Tensor, exact: torch.Tensor) -> float:
    """Share of queries whose set of neighbours differs from the exact one, in %
    (:func:`wrong_sets`)."""
    return 100 * float(wrong_sets(indices, exact).float().mean())


def compare_searches(
    p_query: torch.Tensor, p_ref: torch.Tensor, k: int, n_iters: int = 20
) -> pd.DataFrame:
    """cuML's exact searches (:data:`~extkernels.ops.cuml.ALGORITHMS`) through the
    book's operator, side by side (chapter 3): milliseconds per search
    (:func:`~extkernels.timing.time_fn` over ``n_iters`` calls) and the number of
    queries whose neighbours differ from the brute force's.

    Args:
        p_query: ``(M, 3)`` float32 CUDA; p_ref: ``(N, 3)`` float32 CUDA.

    Returns:
        DataFrame indexed by algorithm, with ``ms per search`` and ``queries with a
        wrong neighbour``.
    """
    _, exact = ops.knn(p_query, p_ref, k, chunk_size=2000)
    rows = {}
    for algorithm in ALGORITHMS:

        def search(a=algorithm):
            return ops.knn(p_query, p_ref, k, backend="cuml", algorithm=a)

        wrong = wrong_sets(search()[1], exact)  # the first call also warms up
        rows[algorithm] = {
            "ms per search": time_fn(search, n_iters),
            "queries with a wrong neighbour": int(wrong.sum()),
        }
    return pd.DataFrame(rows).T


def timing_numbers(table: pd.DataFrame) -> dict[str, float]:
    """The numbers chapter 3's prose quotes from its timing table, by glue key.

    Args:
        table: from :func:`extkernels.benchmark.run_all` over ``knn/torch`` and the
            four cuML variants.

    Returns:
        the compiled operator's forward-pass speedup over the eager brute force
        (``cuml_speedup``) and its forward-pass milliseconds (``cuml_fwd_ms``).
    """
    op = table.loc["knn/cuml-op+compile"]
    return {
        "cuml_speedup": float(op["forward_speedup"]),
        "cuml_fwd_ms": float(op["forward_ms"]),
    }
