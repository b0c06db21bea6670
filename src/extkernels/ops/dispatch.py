"""The public entry points: one per operation, every backend behind it (chapter 1).

Each entry point checks its arguments once, by the contract of
:mod:`~extkernels.ops.checks`, looks up the backend (:mod:`~extkernels.ops.registry`)
and calls it with value checks off, since they just ran. Extra keyword arguments go to
the backend (for example ``chunk_size`` of the torch backend, ``backward`` of the warp
backend).

A batch of clouds packed along the point axis (:mod:`~extkernels.ops.batches`) comes
with ``query_offsets`` and ``ref_offsets``, both or neither: the queries of cloud ``b``
search cloud ``b`` only, and indices are rows of the whole ``p_ref``. A backend whose
record lists the operation in ``batched`` takes the batch in one call; for the others
the entry point loops over the clouds (eager mode only).

Under ``torch.autocast`` the aggregations follow autocast's rule for operations that
need float32: features of a lower precision (the bfloat16 or float16 an autocast MLP
hands them) are cast to float32, and the backend runs with autocast off, so that no
distance of the search is computed in a lower precision and the neighbours stay the
float32 ones. The result is float32, as autocast's float32 operations return.
"""

from __future__ import annotations

import contextlib

import torch

from . import batches
from .checks import (
    call_checked,
    check_knn,
    check_knn_aggregate,
    check_radius_aggregate,
    values_checked,
)
from .neighbour_lists import check_radius_search
from .registry import check_position_grads, get, lookup, registered

__all__ = ["knn", "knn_aggregate", "radius_aggregate", "radius_search", "knn_graph"]


def knn(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    k: int,
    *,
    backend: str = "torch",
    query_offsets: torch.Tensor | None = None,
    ref_offsets: torch.Tensor | None = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` nearest reference points of every query (Euclidean).

    Args:
        p_query: ``(M, 3)`` float32 query points.
        p_ref: ``(N, 3)`` float32 reference points, on the same device.
        k: neighbours per query, ``1 <= k <= N``.
        backend: one of :func:`~extkernels.ops.registry.backends` ``("knn")``.
        query_offsets, ref_offsets: ``(B + 1,)`` int64 offsets of a batch of clouds
            (each cloud with queries holding at least ``k`` reference points), or
            ``None``.

    Returns:
        distances: ``(M, k)`` float32, ascending along each row.
        indices: ``(M, k)`` int64 rows of ``p_ref``.
    """
    k = check_knn(p_query, p_ref, k)
    fn = lookup("knn", backend, p_query.device)
    check_position_grads("knn", backend, p_query, p_ref)
    fn, options = _batched(
        "knn", backend, fn, (p_query, p_ref), query_offsets, ref_offsets, options, k
    )
    return call_checked(fn, p_query, p_ref, k, **options)


def knn_aggregate(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    k: int,
    sigma: float,
    *,
    backend: str = "torch",
    query_offsets: torch.Tensor | None = None,
    ref_offsets: torch.Tensor | None = None,
    **options,
) -> torch.Tensor:
    """kNN-weighted aggregation: features of the k nearest reference points, weighted by
    ``softmax(-distance / sigma)``, summed onto each query. Differentiable in ``feats``
    and, with the neighbours held fixed, in both clouds (a backend without that gradient
    refuses a cloud that requires grad, by name).

    Args:
        p_query: ``(M, 3)`` float32.
        p_ref: ``(N, 3)`` float32.
        feats: ``(N, F)`` float32 features of the reference points.
        k: neighbours per query, ``1 <= k <= N``.
        sigma: softmax length scale, > 0. Past float32's range (about 3e38) the
            weights overflow to NaN: ``1 / sigma`` in the cpp and fused backends,
            ``distance / sigma`` in the torch and ptx ones.
        query_offsets, ref_offsets: as for :func:`knn`.

    Returns:
        ``(M, F)`` float32.
    """
    feats, autocast = _outside_autocast(feats)
    k, sigma = check_knn_aggregate(p_query, p_ref, feats, k, sigma)
    fn = lookup("knn_aggregate", backend, p_query.device)
    check_position_grads("knn_aggregate", backend, p_query, p_ref)
    fn, options = _batched(
        "knn_aggregate",
        backend,
        fn,
        (p_query, p_ref),
        query_offsets,
        ref_offsets,
        options,
        k,
    )
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
    query_offsets: torch.Tensor | None = None,
    ref_offsets: torch.Tensor | None = None,
    **options,
) -> torch.Tensor:
    """Radius-bounded aggregation: features of every reference point within ``radius``,
    weighted by ``exp(-distance / sigma)`` normalised per query; zeros for a query with
    no neighbour. Differentiable in ``feats`` and, with the neighbours held fixed, in
    both clouds (a backend without that gradient refuses a cloud that requires grad, by
    name).

    Args:
        p_query: ``(M, 3)`` float32.
        p_ref: ``(N, 3)`` float32.
        feats: ``(N, F)`` float32.
        radius: neighbourhood radius, > 0.
        sigma: weight length scale, > 0. The torch and warp backends divide by it
            in float32: below about 1.4e-45 it is 0 there and they give NaN.
        query_offsets, ref_offsets: as for :func:`knn` (a cloud may hold no reference
            point: its queries get zeros).

    Returns:
        ``(M, F)`` float32.
    """
    feats, autocast = _outside_autocast(feats)
    radius, sigma = check_radius_aggregate(p_query, p_ref, feats, radius, sigma)
    fn = lookup("radius_aggregate", backend, p_query.device)
    check_position_grads("radius_aggregate", backend, p_query, p_ref)
    fn, options = _batched(
        "radius_aggregate",
        backend,
        fn,
        (p_query, p_ref),
        query_offsets,
        ref_offsets,
        options,
    )
    with autocast:
        return call_checked(fn, p_query, p_ref, feats, radius, sigma, **options)


def _batched(op, backend, fn, clouds, query_offsets, ref_offsets, options, k=0):
    """``fn`` and its options for a call with offsets, checked: the backend's own where
    it takes a batch (``Backend.batched``), else a loop over the clouds, which reads the
    offsets on the host and so refuses to be compiled."""
    p_query, p_ref = clouds
    if not batches.check_call(
        query_offsets, ref_offsets, p_query, p_ref, k, values=values_checked(p_query)
    ):
        return fn, options
    options = {**options, "query_offsets": query_offsets, "ref_offsets": ref_offsets}
    if op in get(backend).batched:
        return fn, options
    if torch.compiler.is_compiling():
        native = [b.name for b in registered() if op in b.batched]
        raise RuntimeError(
            f"backend: {backend!r} takes a batch of clouds by a loop over them, which "
            f"reads query_offsets and ref_offsets on the host and cannot be compiled; "
            f"use backend {' or '.join(repr(n) for n in native)}, which takes the "
            f"batch natively, or call {op} outside torch.compile"
        )
    return batches.per_cloud(op, fn), options


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
    ``b`` take their ``k`` neighbours in cloud ``b``, as :func:`knn` finds them; the
    indices stay rows of ``p_ref``. Indices only: no gradient reaches the clouds.
    """
    with torch.no_grad():
        _, indices = knn(
            p_query,
            p_ref,
            k,
            query_offsets=query_offsets,
            ref_offsets=ref_offsets,
            backend=backend,
            **options,
        )
    rows = torch.arange(p_query.shape[0], device=p_query.device)
    return torch.stack([rows.repeat_interleave(indices.shape[1]), indices.reshape(-1)])


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
