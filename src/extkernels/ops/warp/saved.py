"""The simple hand-over from forward to backward, through ``ctx`` (chapter 6).

The forward's per-query normalisers are tensors, so the plain way to hand them to the
backward is the one every PyTorch tutorial shows: return them as a second output and
keep them with ``ctx.save_for_backward``. The hash grid cannot travel that way (it is a
Warp object, not a tensor), so the backward builds it again.
``warp::radius_aggregate_saved`` does exactly that; ``warp::radius_aggregate`` hands
over the grid too, through the backend's pool (:mod:`~.grids`), and chapter 6 measures
what that saves: one grid build per training step.
"""

# No ``from __future__ import annotations``: torch.library reads the annotations as
# types.
from typing import Any

import torch

from ..checks import check_grad_out, check_radius_aggregate, check_same_device
from ..positions import refuse_position_grads
from .grids import POOL, entry_key
from .interop import where
from .ops import backward, launch_online, new_entry, warp_op

__all__ = [
    "radius_aggregate_saved_op",
    "radius_aggregate_backward_saved_op",
    "setup_context",
]


def _check_norms(norms: object, p_query: torch.Tensor) -> None:
    if not isinstance(norms, torch.Tensor):
        raise TypeError(f"norms: expected a torch.Tensor, got {type(norms).__name__}")
    want = (2, p_query.shape[0])
    if norms.dtype != torch.float32 or tuple(norms.shape) != want:
        raise ValueError(
            f"norms: expected a float32 tensor of shape {want} (the forward's second "
            f"output), got {norms.dtype} {tuple(norms.shape)}"
        )
    if not norms.is_contiguous():
        raise ValueError(
            "norms: expected a contiguous tensor (call .contiguous() first)"
        )
    check_same_device(p_query=p_query, norms=norms)


@warp_op("radius_aggregate_saved")
def radius_aggregate_saved_op(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of ``warp::radius_aggregate``, returning the normalisers too.

    Returns:
        ``out`` ``(M, F)`` float32, and ``norms`` ``(2, M)`` float32: each query's
        nearest in-radius distance and ``1 / sum_j exp((d0 - d_qj) / sigma)``. No grid
        is kept.
    """
    entry, out = launch_online(p_query, p_ref, feats, radius, sigma)
    POOL.release(entry)  # its kernel is queued: the grid may serve the next call
    return out, entry.norms


@radius_aggregate_saved_op.register_fake
def _saved_fake(p_query, p_ref, feats, radius, sigma):
    check_radius_aggregate(p_query, p_ref, feats, radius, sigma, values=False)
    m = p_query.shape[0]
    return p_query.new_empty((m, feats.shape[1])), p_query.new_empty((2, m))


@warp_op("radius_aggregate_backward_saved")
def radius_aggregate_backward_saved_op(
    grad_out: torch.Tensor,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    norms: torch.Tensor,
    radius: float,
    sigma: float,
) -> torch.Tensor:
    """Gradient of ``warp::radius_aggregate_saved`` w.r.t. ``feats`` (Warp's adjoint),
    from the normalisers the forward returned; builds the hash grid again.

    Returns:
        ``(N, F)`` float32 ``grad_feats``, a fresh tensor.
    """
    radius, sigma = check_radius_aggregate(
        p_query, p_ref, feats, radius, sigma, values=False
    )
    check_grad_out(grad_out, p_query, feats)
    _check_norms(norms, p_query)
    # The grid again, with the normalisers from ctx, lent to the standard backward under
    # the key it looks up (it takes the entry out and hands the grid back).
    entry = new_entry(p_query, p_ref, radius, where(p_ref.device), norms=norms)
    POOL.put(entry_key(p_query, p_ref, radius, sigma), entry)
    return backward(grad_out, p_query, p_ref, feats, radius, sigma, "adjoint")


@radius_aggregate_backward_saved_op.register_fake
def _backward_saved_fake(grad_out, p_query, p_ref, feats, norms, radius, sigma):
    check_radius_aggregate(p_query, p_ref, feats, radius, sigma, values=False)
    check_grad_out(grad_out, p_query, feats)
    _check_norms(norms, p_query)
    return torch.empty_like(feats)


def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    """What ``warp::radius_aggregate_saved`` keeps for its backward (chapter 6)."""
    p_query, p_ref, feats, radius, sigma = inputs
    refuse_position_grads(
        "radius_aggregate",
        "warp",
        ctx.needs_input_grad[:2],
        instead="use handover='pool' (the default)",
    )
    _, norms = output
    # The plain way: the normalisers are an output, kept by autograd with the inputs.
    ctx.save_for_backward(p_query, p_ref, feats, norms)
    ctx.radius, ctx.sigma = radius, sigma


def _backward(ctx: Any, grad_out: torch.Tensor, _grad_norms: Any):
    p_query, p_ref, feats, norms = ctx.saved_tensors
    grad_feats = None
    if ctx.needs_input_grad[2]:
        grad_feats = torch.ops.warp.radius_aggregate_backward_saved(
            grad_out.contiguous(), p_query, p_ref, feats, norms, ctx.radius, ctx.sigma
        )
    return None, None, grad_feats, None, None


radius_aggregate_saved_op.register_autograd(_backward, setup_context=setup_context)
