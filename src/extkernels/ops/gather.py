"""The softmax-gather-sum that turns any kNN search into the kNN aggregation (chapter
1).

Every kNN backend hands its ``(distances, indices)`` to :func:`softmax_gather`; the
registry derives each backend's ``knn_aggregate`` this way (see
:mod:`~extkernels.ops.registry`).
"""

from __future__ import annotations

import torch

__all__ = ["gather", "gather_weights_grad", "scatter", "softmax_gather"]


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
