"""Public operators of the running example, one entry point per operation.

``backend`` picks the implementation: ``torch`` (brute force, chapter 1) is always there; other
chapters register more (see :func:`backends`). Every entry point checks its inputs the same way
before dispatching, so a backend may assume well-formed tensors. Extra keyword arguments go to
the backend (for example ``chunk_size`` of the torch backend).
"""

from __future__ import annotations

import torch

from . import cuml_backend, torch_backend, warp_backend  # noqa: F401  (each registers its backend)
from .checks import check_cloud, check_feats, check_k, check_positive, check_same_device
from .registry import backends, lookup

__all__ = ["knn", "knn_aggregate", "radius_aggregate", "backends"]


def _clouds(p_query: torch.Tensor, p_ref: torch.Tensor) -> torch.device:
    check_cloud("p_query", p_query)
    check_cloud("p_ref", p_ref)
    return check_same_device(p_query=p_query, p_ref=p_ref)


def knn(
    p_query: torch.Tensor, p_ref: torch.Tensor, k: int, *, backend: str = "torch", **options
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` nearest reference points of every query (Euclidean).

    Args:
        p_query: ``(M, 3)`` float32 query points.
        p_ref: ``(N, 3)`` float32 reference points, on the same device.
        k: neighbours per query, ``1 <= k <= N``.
        backend: one of :func:`backends` ``("knn")``.

    Returns:
        distances: ``(M, k)`` float32, ascending along each row.
        indices: ``(M, k)`` int64 rows of ``p_ref``.
    """
    device = _clouds(p_query, p_ref)
    k = check_k(k, p_ref.shape[0])
    return lookup("knn", backend, device).fn(p_query, p_ref, k, **options)


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
    device = _clouds(p_query, p_ref)
    check_feats(feats, p_ref.shape[0])
    check_same_device(p_ref=p_ref, feats=feats)
    k = check_k(k, p_ref.shape[0])
    sigma = check_positive("sigma", sigma)
    return lookup("knn_aggregate", backend, device).fn(p_query, p_ref, feats, k, sigma, **options)


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
    weighted by ``exp(-distance / sigma)`` normalised per query; zeros for a query with no
    neighbour. Differentiable in ``feats``.

    Args:
        p_query: ``(M, 3)`` float32.
        p_ref: ``(N, 3)`` float32.
        feats: ``(N, F)`` float32.
        radius: neighbourhood radius, > 0.
        sigma: weight length scale, > 0.

    Returns:
        ``(M, F)`` float32.
    """
    device = _clouds(p_query, p_ref)
    check_feats(feats, p_ref.shape[0])
    check_same_device(p_ref=p_ref, feats=feats)
    radius = check_positive("radius", radius)
    sigma = check_positive("sigma", sigma)
    fn = lookup("radius_aggregate", backend, device).fn
    return fn(p_query, p_ref, feats, radius, sigma, **options)
