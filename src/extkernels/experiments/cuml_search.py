"""Chapter 3's measurements of cuML's search: how many queries get a wrong set of
neighbours, how long each of cuML's exact searches takes, what each part of the book's
operator adds to cuML's call, and the numbers the chapter's prose quotes from its timing
table.
"""

from __future__ import annotations

import pandas as pd
import torch

from .. import ops
from ..ops.cuml import ALGORITHMS
from ..ops.cuml.ops import centred, exact_distances, search
from ..timing import time_fn

__all__ = [
    "PARTS",
    "compare_searches",
    "operator_parts",
    "timing_numbers",
    "wrong_pct",
    "wrong_sets",
]


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


#: The parts of the book's cuML operator, added one at a time to cuML's call as a
#: reader first writes it (``algorithm="auto"``, raw coordinates, cuML's own distances):
#: name -> the options of :func:`_search_with` (``None``: the package's ``cuml::knn``,
#: which adds its argument checks, finite coordinates included).
PARTS = {
    "cuML's call: auto, raw clouds, cuML's distances": {},
    "+ algorithm rbc named": {"algorithm": "rbc"},
    "+ clouds centred": {"algorithm": "rbc", "centre": True},
    "+ wait, copy, wait": {"algorithm": "rbc", "centre": True, "wait": True},
    "+ exact distances (tutorial::knn)": {
        "algorithm": "rbc",
        "centre": True,
        "wait": True,
        "exact": True,
    },
    "+ argument checks (cuml::knn)": None,
}


def _search_with(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    k: int,
    algorithm: str = "auto",
    centre: bool = False,
    wait: bool = False,
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuML's search with some of the operator's parts: ``centre`` the clouds, ``wait``
    for PyTorch's stream before cuML reads and copy the indices out and wait again, and
    recompute ``exact`` distances (sorted) instead of returning cuML's."""
    q, r = centred(p_query, p_ref) if centre else (p_query, p_ref)
    stream = torch.cuda.current_stream(p_query.device)
    if wait:
        stream.synchronize()
    distances, found = search(q, r, k, algorithm)
    if wait:
        indices = torch.empty(
            (p_query.shape[0], k), dtype=torch.int64, device=p_query.device
        )
        indices.copy_(torch.from_dlpack(found))
        stream.synchronize()
    else:
        indices = torch.from_dlpack(found).long()
    if exact:
        return exact_distances(p_query, p_ref, indices)
    return torch.from_dlpack(distances), indices


def operator_parts(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    k: int,
    n_iters: int = 10,
    repeats: int = 7,
) -> pd.DataFrame:
    """What each part of the book's cuML operator costs (chapter 3): the :data:`PARTS`,
    each added to the ones above it, timed in turn in one process (``repeats`` rounds,
    each a block of ``n_iters`` calls of every part, timed by
    :func:`~extkernels.timing.time_fn`).

    Args:
        p_query: ``(M, 3)`` float32 CUDA; p_ref: ``(N, 3)`` float32 CUDA.

    Returns:
        DataFrame indexed by part, with the median block's ``ms per call``, the fastest
        and slowest blocks (``min``, ``max``) and the median's difference from the row
        above (``added ms``).
    """
    calls = {}
    for name, options in PARTS.items():
        if options is None:
            calls[name] = lambda: torch.ops.cuml.knn(p_query, p_ref, k)
        else:
            calls[name] = lambda o=options: _search_with(p_query, p_ref, k, **o)
    for call in calls.values():
        call()  # warm-up: cuML's first fit, the operator's first dispatch
    times = {name: [] for name in calls}
    for _ in range(repeats):  # in turn, so that a drift of the machine hits every part
        for name, call in calls.items():
            times[name].append(time_fn(call, n_iters))
    table = pd.DataFrame(
        {
            name: {"ms per call": pd.Series(t).median(), "min": min(t), "max": max(t)}
            for name, t in times.items()
        }
    ).T
    table["added ms"] = table["ms per call"].diff()
    return table


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
