"""The brute force in plain PyTorch (chapter 1; compiled in chapter 2): the reference.

Every query is compared with every reference point, so time and memory grow as N x M:
the difference tensor alone is ``(M, N, 3)``. ``chunk_size`` processes the queries in
slices of that many rows to cap the memory at ``chunk_size x N``; ``None`` keeps the
single-shot form whose cost chapter 1 measures. These functions accept float64 too, for
gradient checks of other backends.
"""

from __future__ import annotations

import torch

__all__ = ["knn", "radius_aggregate"]


def _chunks(p_query: torch.Tensor, chunk_size: int | None) -> tuple[torch.Tensor, ...]:
    if chunk_size is None:
        return (p_query,)
    if chunk_size < 1:
        raise ValueError(
            "chunk_size: expected a positive number of queries or None, got "
            f"{chunk_size}"
        )
    return p_query.split(chunk_size)


def _distances(p_query: torch.Tensor, p_ref: torch.Tensor) -> torch.Tensor:
    # The straightforward form: an (M, N, 3) difference, then its norm. torch.cdist
    # would be leaner, but this is the code the book starts from and the compiler fuses.
    # Differences of coordinates, not |a|^2 - 2 a.b + |b|^2, which loses digits far from
    # the origin.
    return (p_query[:, None, :] - p_ref[None, :, :]).norm(dim=-1)


def knn(
    p_query: torch.Tensor, p_ref: torch.Tensor, k: int, *, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """k nearest reference points of every query by brute force.

    Args:
        p_query: ``(M, 3)`` query points.
        p_ref: ``(N, 3)`` reference points.
        k: neighbours per query, ``1 <= k <= N``.
        chunk_size: queries per slice, or None for one slice.

    Returns:
        distances ``(M, k)`` ascending along each row, and indices ``(M, k)`` int64 into
        p_ref.
    """
    parts = [
        _distances(q, p_ref).topk(k, dim=1, largest=False)
        for q in _chunks(p_query, chunk_size)
    ]
    if len(parts) == 1:
        return parts[0].values, parts[0].indices
    return torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts])


def radius_aggregate(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Radius-bounded aggregation of ``feats`` (N, F) onto the queries; returns ``(M,
    F)``.

    Weights ``exp(-distance / sigma)`` over the reference points within ``radius``,
    normalised per query; a query with no neighbour gets zeros. The weights depend on
    geometry only, so the gradient reaches ``feats`` through the final matrix product.
    """
    out = []
    for q in _chunks(p_query, chunk_size):
        with torch.no_grad():
            d = _distances(q, p_ref)
            inside = d <= radius
            # Shifting by each query's nearest in-radius distance cancels in the
            # normalisation and keeps exp() from underflowing when radius / sigma is
            # large.
            nearest = torch.where(inside, d, torch.inf).amin(dim=1, keepdim=True)
            nearest = torch.where(torch.isinf(nearest), 0.0, nearest)
            w = torch.where(inside, torch.exp((nearest - d) / sigma), 0.0).to(
                feats.dtype
            )
            # An empty neighbourhood has w == 0 everywhere, so dividing by tiny keeps it
            # at 0.
            w = w / w.sum(dim=1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
        out.append(w @ feats)
    return out[0] if len(out) == 1 else torch.cat(out)
