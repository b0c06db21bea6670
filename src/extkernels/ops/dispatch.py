"""The public entry points: one per operation, every backend behind it (chapter 1).

Each entry point checks its arguments once, by the contract of
:mod:`~extkernels.ops.checks`, looks up the backend (:mod:`~extkernels.ops.registry`)
and calls it with value checks off, since they just ran. Extra keyword arguments go to
the backend (for example ``chunk_size`` of the torch backend, ``backward`` of the warp
backend).

Under ``torch.autocast`` the aggregations follow autocast's rule for operations that
need float32: features of a lower precision (the bfloat16 or float16 an autocast MLP
hands them) are cast to float32, and the backend runs with autocast off, so that no
distance of the search is computed in a lower precision and the neighbours stay the
float32 ones. The result is float32, as autocast's float32 operations return.
"""

from __future__ import annotations

import contextlib

import torch

from .batches import check_batch, check_clouds_hold
from .checks import (
    call_checked,
    check_k,
    check_knn,
    check_knn_aggregate,
    check_radius_aggregate,
    values_checked,
)
from .neighbour_lists import check_radius_search
from .registry import check_position_grads, lookup

__all__ = ["knn", "knn_aggregate", "radius_aggregate", "radius_search", "knn_graph"]


def knn(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    k: int,
    *,
    backend: str = "torch",
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` nearest reference points of every query (Euclidean).

    Args:
        p_query: ``(M, 3)`` float32 query points.
        p_ref: ``(N, 3)`` float32 reference points, on the same device.
        k: neighbours per query, ``1 <= k <= N``.
        backend: one of :func:`~extkernels.ops.registry.backends` ``("knn")``.

    Returns:
        distances: ``(M, k)`` float32, ascending along each row.
        indices: ``(M, k)`` int64 rows of ``p_ref``.
    """
    k = check_knn(p_query, p_ref, k)
    fn = lookup("knn", backend, p_query.device)
    check_position_grads("knn", backend, p_query, p_ref)
    return call_checked(fn, p_query, p_ref, k, **options)


def knn_aggregate(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    k: int,
    sigma: float,
    *,
    backend: str = "torch",
    **options,
) -> torch.Tensor:
    """kNN-weighted aggregation: features of the k nearest reference points, weighted by
    ``softmax(-distance / sigma)``, summed onto each query. Differentiable in ``feats``.

    Args:
        p_query: ``(M, 3)`` float32.
        p_ref: ``(N, 3)`` float32.
        feats: ``(N, F)`` float32 features of the reference points.
        k: neighbours per query, ``1 <= k <= N``.
        sigma: softmax length scale, > 0.

    Returns:
        ``(M, F)`` float32.
    """
    feats, autocast = _outside_autocast(feats)
    k, sigma = check_knn_aggregate(p_query, p_ref, feats, k, sigma)
    fn = lookup("knn_aggregate", backend, p_query.device)
    check_position_grads("knn_aggregate", backend, p_query, p_ref)
    with autocast:
        return call_checked(fn, p_query, p_ref, feats, k, sigma, **options)


def radius_aggregate(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
    *,
    backend: str = "torch",
    **options,
) -> torch.Tensor:
    """Radius-bounded aggregation: features of every reference point within ``radius``,
    weighted by ``exp(-distance / sigma)`` normalised per query; zeros for a query with
    no neighbour. Differentiable in ``feats``.

    Args:
        p_query: ``(M, 3)`` float32.
        p_ref: ``(N, 3)`` float32.
        feats: ``(N, F)`` float32.
        radius: neighbourhood radius, > 0.
        sigma: weight length scale, > 0.

    Returns:
        ``(M, F)`` float32.
    """
    feats, autocast = _outside_autocast(feats)
    radius, sigma = check_radius_aggregate(p_query, p_ref, feats, radius, sigma)
    fn = lookup("radius_aggregate", backend, p_query.device)
    check_position_grads("radius_aggregate", backend, p_query, p_ref)
    with autocast:
        return call_checked(fn, p_query, p_ref, feats, radius, sigma, **options)


def radius_search(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    radius: float,
    *,
    max_neighbours: int | None = None,
    query_offsets: torch.Tensor | None = None,
    ref_offsets: torch.Tensor | None = None,
    backend: str = "torch",
    **options,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every reference point within ``radius`` (inclusive) of each query, sorted by
    distance within each query, equal distances by the lower reference index.
    Differentiable in both clouds through the distances (the neighbours held fixed).

    Args:
        p_query: ``(M, 3)`` float32 (or float64, where the backend takes it) queries.
        p_ref: ``(N, 3)`` reference points of the same dtype, on the same device;
            either cloud may be empty.
        radius: finite, > 0.
        max_neighbours: ``None`` for every neighbour, or ``K >= 1`` for the ``K``
            nearest within the radius.
        query_offsets, ref_offsets: ``(B + 1,)`` int64 offsets of clouds packed along
            the point axis (:mod:`~extkernels.ops.batches`), both or neither: the
            queries of cloud ``b`` search cloud ``b`` only; indices stay rows of
            ``p_ref``.

    Returns:
        With ``max_neighbours=None``, CSR: ``offsets`` ``(M + 1,)`` int64 (query ``i``'s
        neighbours are entries ``offsets[i]:offsets[i + 1]``), ``indices`` ``(E,)``
        int64 rows of ``p_ref`` and ``distances`` ``(E,)`` of the clouds' dtype. ``E``
        depends on the data: sizing it synchronises with the host once.
        With ``max_neighbours=K``: ``indices`` ``(M, K)`` int64 and ``distances``
        ``(M, K)``, nearest first, unused slots holding index -1 and distance +inf, and
        ``counts`` ``(M,)`` int64, ``min(found, K)``.
    """
    radius, max_neighbours = check_radius_search(
        p_query, p_ref, radius, max_neighbours, query_offsets, ref_offsets
    )
    fn = lookup("radius_search", backend, p_query.device)
    check_position_grads("radius_search", backend, p_query, p_ref)
    return call_checked(
        fn,
        p_query,
        p_ref,
        radius,
        max_neighbours,
        query_offsets,
        ref_offsets,
        **options,
    )


def knn_graph(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    k: int,
    *,
    query_offsets: torch.Tensor | None = None,
    ref_offsets: torch.Tensor | None = None,
    backend: str = "torch",
    **options,
) -> torch.Tensor:
    """The kNN graph as an edge list for graph layers: ``(2, M * k)`` int64, row 0 the
    query (the target, which aggregates), row 1 its neighbour in ``p_ref`` (the
    source), edges grouped by query, nearest first. That is ``torch_cluster.knn``'s
    order, PyG's ``knn_graph(..., flow="target_to_source")``; for a layer with PyG's
    default ``flow="source_to_target"``, use ``edges.flip(0)``.

    With ``query_offsets`` and ``ref_offsets`` (both or neither), the queries of cloud
    ``b`` take their ``k`` neighbours in cloud ``b``, which must hold ``k``; the
    indices stay rows of ``p_ref``. The batched form calls :func:`knn` once per cloud
    (reading the offsets on the host), so it is for eager code. Indices only: no
    gradient reaches the clouds.
    """
    if (query_offsets is None) != (ref_offsets is None):
        missing = "ref_offsets" if ref_offsets is None else "query_offsets"
        raise ValueError(f"{missing}: expected offsets too, since the other is given")
    with torch.no_grad():
        if query_offsets is None:
            _, indices = knn(p_query, p_ref, k, backend=backend, **options)
            rows = torch.arange(p_query.shape[0], device=p_query.device)
            return torch.stack([rows.repeat_interleave(k), indices.reshape(-1)])
        check_batch(
            query_offsets,
            ref_offsets,
            p_query.shape[0],
            p_ref.shape[0],
            values=values_checked(query_offsets),
        )
        k = check_k(k, p_ref.shape[0])
        check_clouds_hold(query_offsets, ref_offsets, k)
        edges = [p_query.new_empty(2, 0, dtype=torch.int64)]
        bounds = zip(query_offsets.tolist(), ref_offsets.tolist(), strict=True)
        (q0, r0), *rest = bounds
        for q1, r1 in rest:
            if q1 > q0:
                _, found = knn(
                    p_query[q0:q1], p_ref[r0:r1], k, backend=backend, **options
                )
                rows = torch.arange(q0, q1, device=p_query.device).repeat_interleave(k)
                edges.append(torch.stack([rows, found.reshape(-1) + r0]))
            q0, r0 = q1, r1
        return torch.cat(edges, dim=1)


def _outside_autocast(feats: torch.Tensor):
    """Inside an autocast region of ``feats``' device: ``feats`` in float32 where it
    came in a lower precision, and a context that turns autocast off around the
    backend; elsewhere ``feats`` unchanged and a context that does nothing."""
    device = feats.device.type if isinstance(feats, torch.Tensor) else "cpu"
    if not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(
        device
    ):
        return feats, contextlib.nullcontext()
    if feats.dtype in (torch.float16, torch.bfloat16):
        feats = feats.float()
    return feats, torch.autocast(device, enabled=False)
