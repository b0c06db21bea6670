"""The softmax-gather-sum that turns any kNN search into the kNN aggregation (chapter
1).

Every kNN backend hands its ``(distances, indices)`` to :func:`softmax_gather`; the
registry derives each backend's ``knn_aggregate`` this way (see
:mod:`~extkernels.ops.registry`). :func:`csr_aggregate` does the same for a radius
search's neighbour lists (chapter 16).
"""

from __future__ import annotations

import torch

from .batches import cloud_of

__all__ = [
    "csr_aggregate",
    "gather",
    "gather_weights_grad",
    "scatter",
    "softmax_gather",
]


def softmax_gather(
    distances: torch.Tensor, indices: torch.Tensor, feats: torch.Tensor, sigma: float
) -> torch.Tensor:
    """Weighted sum of neighbour features, weights ``softmax(-distance / sigma)`` over
    k.

    Gradients flow to ``feats`` through the gather; distances and indices carry none.

    Args:
        distances: ``(M, k)`` float32, ascending along each row.
        indices: ``(M, k)`` int64 rows of ``feats``.
        feats: ``(N, F)`` float32 (float64 for gradient checks).
        sigma: softmax length scale, > 0.

    Returns:
        ``(M, F)``, same dtype as ``feats``.
    """
    weights = torch.softmax(-distances.to(feats.dtype) / sigma, dim=1)
    return gather(weights, indices, feats)


def gather(
    weights: torch.Tensor, indices: torch.Tensor, feats: torch.Tensor
) -> torch.Tensor:
    """The gather in PyTorch: ``out[q] = sum_j weights[q, j] * feats[indices[q, j]]``,
    ``(M, F)``."""
    return (weights.unsqueeze(-1) * feats[indices]).sum(dim=1)


def gather_weights_grad(
    grad_out: torch.Tensor, indices: torch.Tensor, feats: torch.Tensor
) -> torch.Tensor:
    """The gather's gradient with respect to its weights: ``grad[q, j] = <grad_out[q],
    feats[indices[q, j]]>``, ``(M, k)``."""
    return (grad_out.unsqueeze(1) * feats[indices]).sum(dim=-1)


def scatter(
    grad_out: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, n_ref: int
) -> torch.Tensor:
    """The gather's adjoint in PyTorch: ``grad[indices[q, j]] += weights[q, j] *
    grad_out[q]``, ``(n_ref, F)``. Differentiable in ``grad_out`` and ``weights``: the
    backends' backwards take it instead of their kernels when autograd records the
    backward itself (``create_graph=True``)."""
    m, k = weights.shape
    rows = (weights.unsqueeze(-1) * grad_out.unsqueeze(1)).reshape(m * k, -1)
    grad = grad_out.new_zeros((n_ref, grad_out.shape[1]))
    return grad.index_add(0, indices.reshape(-1), rows.to(grad.dtype))


def csr_aggregate(
    offsets: torch.Tensor,
    indices: torch.Tensor,
    distances: torch.Tensor,
    feats: torch.Tensor,
    sigma: float,
) -> torch.Tensor:
    """The radius aggregation from a radius search's CSR neighbour lists (chapter 16):
    ``out[q]`` is the sum of ``feats[indices[e]]`` over query ``q``'s entries
    ``offsets[q]:offsets[q + 1]``, weighted by ``exp(-distances[e] / sigma)``
    normalised over them; a query without neighbours gets zeros. Gradients reach
    ``feats`` and, through ``distances``, the clouds. Each query's nearest distance is
    subtracted before ``exp`` (it cancels in the normalisation and keeps the weights
    from underflowing), as in the PyTorch brute force; the sizes stay symbolic, so
    this compiles after a search whose fake sizes its output with an unbacked size.

    Returns ``(M, F)``, the dtype of ``feats``."""
    m = offsets.shape[0] - 1
    rows = cloud_of(offsets, indices.shape[0])  # each entry's query
    d = distances.to(feats.dtype)
    with torch.no_grad():
        nearest = d.new_full((m,), torch.inf).scatter_reduce(0, rows, d, "amin")
    w = torch.exp((nearest[rows] - d) / sigma)
    total = w.new_zeros(m).index_add(0, rows, w)
    out = feats.new_zeros(m, feats.shape[1]).index_add(
        0, rows, w.unsqueeze(1) * feats[indices]
    )
    return out / total.clamp_min(torch.finfo(w.dtype).tiny).unsqueeze(1)
