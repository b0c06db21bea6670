"""The warp backend's gradient with respect to the point positions (chapter 6).

``warp::radius_aggregate_positions_backward`` launches :data:`~.kernels.positions` over
the grid the forward left in the pool (or a grid built again), and returns the
gradients of both clouds; its fake is right beneath it. The forward operators' autograd
formula (:func:`~.ops.attach_backward`) calls it when a cloud requires grad.
"""

# No ``from __future__ import annotations``: torch.library reads the annotations as
# types.
import torch

from ..checks import (
    alert_not_deterministic,
    check_buffer,
    check_grad_out,
    check_radius_aggregate,
)
from .grids import POOL, entry_key
from .interop import descriptor, launch, where
from .ops import backward_entry, kernels, warp_op

__all__ = ["radius_aggregate_positions_backward_op"]


def _check(grad_out, out, p_query, p_ref, feats, radius, sigma) -> tuple[float, float]:
    radius, sigma = check_radius_aggregate(
        p_query, p_ref, feats, radius, sigma, values=False
    )
    check_grad_out(grad_out, p_query, feats)
    want = (p_query.shape[0], feats.shape[1])
    check_buffer("out", out, want, "M, F", torch.float32, p_query)
    return radius, sigma


@warp_op("radius_aggregate_positions_backward")
def radius_aggregate_positions_backward_op(
    grad_out: torch.Tensor,
    out: torch.Tensor,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
    keep: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``warp::radius_aggregate`` with respect to both clouds, the
    neighbours held fixed.

    Args:
        grad_out: ``(M, F)`` float32, contiguous: the gradient of the output.
        out: ``(M, F)`` float32, contiguous: the forward's output.
        p_query, p_ref, feats, radius, sigma: the forward's arguments.
        keep: leave the forward's grid in the pool, for the features' backward that
            follows.

    Returns:
        ``grad_query`` ``(M, 3)`` and ``grad_ref`` ``(N, 3)`` float32, fresh tensors.
    """
    radius, sigma = _check(grad_out, out, p_query, p_ref, feats, radius, sigma)
    if p_ref.device.type == "cuda":
        alert_not_deterministic("warp::radius_aggregate (positions, atomic adds)")
    kernel_module = kernels()
    at = where(p_ref.device)
    entry = backward_entry(p_query, p_ref, radius, sigma, at)
    grad_query = torch.empty_like(p_query)
    grad_ref = torch.zeros_like(p_ref)  # the kernel accumulates into it
    vec3 = kernel_module.wp.vec3
    launch(
        kernel_module.positions,
        (p_query.shape[0],),
        [entry.grid_id, *entry.points, descriptor(feats), *entry.norm_descs]
        + [radius, sigma]
        + [descriptor(grad_out), descriptor(out)]
        + [descriptor(grad_query, vec3), descriptor(grad_ref, vec3)],
        at,
    )
    if keep:
        POOL.put(entry_key(p_query, p_ref, radius, sigma), entry)
    else:
        POOL.release(entry)
    return grad_query, grad_ref


@radius_aggregate_positions_backward_op.register_fake
def _positions_backward_fake(grad_out, out, p_query, p_ref, feats, radius, sigma, keep):
    _check(grad_out, out, p_query, p_ref, feats, radius, sigma)
    return torch.empty_like(p_query), torch.empty_like(p_ref)
