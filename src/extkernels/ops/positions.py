"""Gradients with respect to the point positions, shared by every backend (chapter 6).

The neighbours a search picks are piecewise constant in the positions, so they are held
fixed, as PyTorch3D's ``knn_points`` does: the gradient reaches ``p_query`` and
``p_ref`` through the distance of each (query, neighbour) pair and, in the
aggregations, through the weights made of those distances. Everything here is PyTorch
operations on the neighbours' indices, so a backward made of them has fakes already,
compiles with ``fullgraph=True`` and can itself be differentiated (second order).

A distance of exactly zero (a query that is one of the reference points) has no
derivative; its gradient is taken as zero, in the first order and the second, never
NaN.

A backend that cannot differentiate an operation with respect to positions leaves the
operation out of its ``position_grads`` (:class:`~extkernels.ops.registry.Backend`),
and :func:`~extkernels.ops.registry.check_position_grads` refuses the call at forward
time, naming the argument.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from .gather import gather_weights_grad, scatter

__all__ = [
    "distance_backward",
    "knn_aggregate_backward",
    "neighbour_distances",
    "pairwise_distances",
    "refuse_position_grads",
    "register_knn_aggregate_autograd",
    "register_knn_autograd",
    "register_radius_search_autograd",
    "safe_norm",
    "with_position_grads",
    "wants_grad",
]


def safe_norm(diff: torch.Tensor) -> torch.Tensor:
    """The Euclidean norm over the last axis whose gradient, and the gradient's
    gradient, are zero where the norm is zero (``torch.norm``'s second derivative is NaN
    there)."""
    squared = (diff * diff).sum(dim=-1)
    nonzero = squared > 0
    return torch.where(nonzero, torch.where(nonzero, squared, 1.0).sqrt(), 0.0)


def neighbour_distances(
    p_query: torch.Tensor, p_ref: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """``(M, k)`` distances from each query to its neighbours ``indices`` ``(M, k)``
    int64, differentiable in both ``(M, 3)`` and ``(N, 3)`` clouds."""
    return safe_norm(p_query.unsqueeze(1) - p_ref[indices])


def pairwise_distances(p_query: torch.Tensor, p_ref: torch.Tensor) -> torch.Tensor:
    """``(M, N)`` distances of every pair, differentiable in both clouds (the brute
    force's, for a caller that asks for position gradients)."""
    return safe_norm(p_query[:, None, :] - p_ref[None, :, :])


def with_position_grads(
    distances: torch.Tensor,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    indices: torch.Tensor,
) -> torch.Tensor:
    """``distances`` ``(M, k)`` as a search returned them, bit for bit, with the
    gradient of :func:`neighbour_distances` attached (when a cloud requires grad)."""
    if not wants_grad(p_query, p_ref):
        return distances
    exact = neighbour_distances(p_query, p_ref, indices)
    return distances.detach() + (exact - exact.detach())


def wants_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records a call on ``tensors``: grad mode is on and one of them
    requires grad."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


def distance_backward(
    grad_distances: torch.Tensor,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    indices: torch.Tensor,
    needs: tuple[bool, bool] = (True, True),
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The clouds' gradients from the distances' gradient ``(M, k)``: each pair's
    ``grad * (q - r) / |q - r|`` summed onto its query, and subtracted from its
    reference point. ``needs`` says which of the two to compute."""
    diff = p_query.unsqueeze(1) - p_ref[indices]  # (M, k, 3)
    d = safe_norm(diff)
    nonzero = d > 0
    scale = torch.where(nonzero, grad_distances / torch.where(nonzero, d, 1.0), 0.0)
    pull = scale.unsqueeze(-1) * diff
    grad_query = pull.sum(dim=1) if needs[0] else None
    grad_ref = None
    if needs[1]:
        grad_ref = torch.zeros_like(p_ref).index_add(
            0, indices.reshape(-1), -pull.reshape(-1, 3)
        )
    return grad_query, grad_ref


def knn_aggregate_backward(
    grad_out: torch.Tensor,
    grad_weights: torch.Tensor | None,
    weights: torch.Tensor,
    indices: torch.Tensor,
    feats: torch.Tensor,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    sigma: float,
    needs: tuple[bool, bool] = (True, True),
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The clouds' gradients of ``out[q] = sum_j weights[q, j] * feats[indices[q, j]]``
    with ``weights = softmax(-distances / sigma)`` over each row: through the softmax
    into the distances, then :func:`distance_backward`.

    Args:
        grad_out: ``(M, F)``, the output's gradient.
        grad_weights: ``(M, k)`` gradient of the weights where the operator returns them
            and a caller used them (``None`` otherwise).
        weights, indices: ``(M, k)`` float32 and int64, as the forward returned them.
        feats: ``(N, F)``; p_query, p_ref: ``(M, 3)``, ``(N, 3)``.
    """
    # d loss / d weights[q, j] = <grad_out[q], feats[indices[q, j]]> (+ grad_weights)
    upstream = gather_weights_grad(grad_out, indices, feats).to(weights.dtype)
    if grad_weights is not None:
        upstream = upstream + grad_weights
    centred = upstream - (weights * upstream).sum(dim=1, keepdim=True)
    grad_distances = -(weights / sigma) * centred
    return distance_backward(grad_distances, p_query, p_ref, indices, needs)


def register_knn_autograd(op: str) -> None:
    """Give the search operator ``op`` (inputs ``p_query, p_ref, k, ...``, outputs
    ``(distances, indices)``) the gradient of its distances with respect to both clouds
    (chapter 6): the indices carry none."""

    def setup_context(ctx, inputs, output):
        p_query, p_ref, *_ = inputs
        _, indices = output
        ctx.save_for_backward(p_query, p_ref, indices)
        ctx.mark_non_differentiable(indices)

    def backward(ctx, grad_distances, _grad_indices):
        p_query, p_ref, indices = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:2])
        grads = distance_backward(grad_distances, p_query, p_ref, indices, needs)
        return *grads, *(None,) * (len(ctx.needs_input_grad) - 2)

    torch.library.register_autograd(op, backward, setup_context=setup_context)


def register_knn_aggregate_autograd(op: str, scatter_kernel: Callable) -> None:
    """Give the kNN aggregation operator ``op`` (inputs ``p_query, p_ref, feats, k,
    sigma, ...``, outputs ``(out, weights, indices)``) its autograd formula: the
    features' gradient by ``scatter_kernel(grad_out, weights, indices, n_ref)`` (the
    gather's adjoint, ``(N, F)``), the clouds' through the weights
    (:func:`knn_aggregate_backward`). A backward that autograd records
    (``create_graph=True``) scatters in PyTorch instead, so that it can be
    differentiated again."""

    def setup_context(ctx, inputs, output):
        p_query, p_ref, feats, _, sigma, *_ = inputs
        _, weights, indices = output
        ctx.save_for_backward(p_query, p_ref, feats, weights, indices)
        ctx.mark_non_differentiable(indices)
        ctx.sigma = sigma

    def backward(ctx, grad_out, grad_weights, _grad_indices):
        p_query, p_ref, feats, weights, indices = ctx.saved_tensors
        needs = ctx.needs_input_grad
        # The incoming gradient may be a broadcast view (the backward of a sum is an
        # expand): a kernel reads rows densely.
        grad_out = grad_out.contiguous()
        grad_feats = grad_query = grad_ref = None
        if needs[2]:
            adjoint = scatter if torch.is_grad_enabled() else scatter_kernel
            grad_feats = adjoint(grad_out, weights, indices, p_ref.shape[0])
        if needs[0] or needs[1]:
            grad_query, grad_ref = knn_aggregate_backward(
                grad_out,
                grad_weights,
                weights,
                indices,
                feats,
                p_query,
                p_ref,
                ctx.sigma,
                (needs[0], needs[1]),
            )
        others = (None,) * (len(needs) - 3)  # k, sigma, any options
        return grad_query, grad_ref, grad_feats, *others

    torch.library.register_autograd(op, backward, setup_context=setup_context)


def _csr_setup(ctx, inputs, output):
    p_query, p_ref, *_ = inputs
    _, offsets, indices = output
    ctx.save_for_backward(p_query, p_ref, offsets, indices)
    ctx.mark_non_differentiable(offsets, indices)


def _csr_backward(ctx, grad_distances, _grad_offsets, _grad_indices):
    p_query, p_ref, offsets, indices = ctx.saved_tensors
    needs = tuple(ctx.needs_input_grad[:2])
    rows = torch.repeat_interleave(
        torch.arange(p_query.shape[0], device=p_query.device),
        offsets.diff(),
        output_size=indices.shape[0],
    )
    # One "query" per edge, one neighbour each: the kNN formula, then each edge's
    # query gradient summed onto its query.
    grad_edges, grad_ref = distance_backward(
        grad_distances.unsqueeze(1), p_query[rows], p_ref, indices.unsqueeze(1), needs
    )
    grad_query = None
    if needs[0]:
        grad_query = torch.zeros_like(p_query).index_add(0, rows, grad_edges)
    return grad_query, grad_ref, *(None,) * (len(ctx.needs_input_grad) - 2)


def _padded_setup(ctx, inputs, output):
    p_query, p_ref, *_ = inputs
    _, indices, counts = output
    ctx.save_for_backward(p_query, p_ref, indices)
    ctx.mark_non_differentiable(indices, counts)


def _padded_backward(ctx, grad_distances, _grad_indices, _grad_counts):
    p_query, p_ref, indices = ctx.saved_tensors
    needs = tuple(ctx.needs_input_grad[:2])
    used = indices >= 0  # unused slots take no gradient
    grads = distance_backward(
        torch.where(used, grad_distances, 0.0),
        p_query,
        p_ref,
        indices.clamp_min(0),
        needs,
    )
    return *grads, *(None,) * (len(ctx.needs_input_grad) - 2)


def register_radius_search_autograd(csr: str, padded: str) -> None:
    """The distances' gradients of a radius search's two operators (``p_query`` and
    ``p_ref`` their first arguments), the neighbours held fixed: ``csr`` returns
    ``(distances (E,), offsets (M + 1,), indices (E,))``, ``padded`` returns
    ``(distances (M, K), indices (M, K), counts (M,))``, index -1 in unused slots."""
    torch.library.register_autograd(csr, _csr_backward, setup_context=_csr_setup)
    torch.library.register_autograd(
        padded, _padded_backward, setup_context=_padded_setup
    )


def refuse_position_grads(
    op: str,
    backend: str,
    needs: tuple[bool, bool],
    others: Iterable[str] = (),
    instead: str = "",
) -> None:
    """Raise when ``needs`` (whether ``p_query`` and ``p_ref`` require grad) holds a
    True: backend ``backend`` has no gradient of ``op`` with respect to positions;
    ``others`` are the backends that have one. The entry points call it at forward time
    (:func:`~extkernels.ops.registry.check_position_grads`), and so does the
    ``setup_context`` of an operator without that gradient, with
    ``ctx.needs_input_grad[:2]``. ``instead``: another way of the same backend that
    has the gradient, named before the other backends."""
    named = [n for n, need in zip(("p_query", "p_ref"), needs, strict=True) if need]
    if not named:
        return
    which = " and ".join(named)
    verb = "require" if len(named) > 1 else "requires"
    alternatives = " or ".join(f"'{b}'" for b in others)
    ways = [instead] if instead else []
    ways += [f"use backend {alternatives}"] if alternatives else []
    use = " or ".join([*ways, "detach it"])
    raise ValueError(
        f"{which} {verb} grad; backend '{backend}' has no gradient of {op} with "
        f"respect to positions: {use}"
    )
