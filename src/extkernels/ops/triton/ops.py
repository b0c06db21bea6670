"""The Triton kNN search as a PyTorch operator the compiler traces into (chapter 8).

``torch.library.triton_op`` registers a Python function that launches Triton kernels
through ``torch.library.wrap_triton``: in eager mode it runs as written; under
``torch.compile`` inductor traces into it and sees the kernel launch itself, so a
fake implementation is optional (the search registers a small one).
``register_kernel("cpu")`` gives the operator a CPU implementation, the brute force;
the tests run the kernels themselves on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``) by calling the launchers :func:`launch_knn` and
:func:`launch_knn_aggregate`.
"""

# No ``from __future__ import annotations``: torch.library reads the annotations as
# types.
import torch
import triton
from torch.library import wrap_triton
from torch.utils.flop_counter import register_flop_formula

from .. import positions
from ..checks import (
    alert_not_deterministic,
    check_index_limit,
    check_knn,
    check_knn_aggregate,
)
from ..gather import gather as torch_gather
from ..gather import scatter
from ..torch.brute_force import knn as brute_force_knn
from . import spatial
from .kernels import (
    MAX_INDEX,
    gather_kernel,
    knn_aggregate_kernel,
    knn_kernel,
    knn_kernel_autotuned,
    next_power_of_2,
    scatter_kernel,
)

__all__ = [
    "check_sizes",
    "launch_knn",
    "search",
    "knn_op",
    "knn_cpu",
    "knn_fake",
    "launch_knn_aggregate",
    "knn_aggregate_fwd_op",
    "knn_aggregate_bwd_op",
    "knn_aggregate",
    "gather",
]

#: Queries per program, and reference points per step of the brute force.
BLOCK_Q, BLOCK_R = 16, 64
#: Warps per program of the search kernels.
NUM_WARPS = 1


# Why the sizes are bounded: offsets the kernels compute in 32-bit integers.
_COORDS = "the Triton kernels offset coordinates by 3 × row in 32-bit integers"
_BACKWARD = "the Triton backward offsets rows of {} by row × {} in 32-bit integers"


def _check_backward_sizes(m, f, k, rows: str = "grad_out", weights: str = "weights"):
    """The scatter's offsets, ``q * F`` into ``grad_out`` and ``q * K`` into the weights
    and indices: ``M F`` and ``M k`` at most :data:`~.kernels.MAX_INDEX`."""
    why = _BACKWARD.format("grad_out", "F")
    check_index_limit(rows, "queries × features", m * f, MAX_INDEX, why)
    why = _BACKWARD.format("the weights", "k")
    check_index_limit(weights, "queries × neighbours", m * k, MAX_INDEX, why)


def check_sizes(p_query, p_ref, feats=None, k=None) -> None:
    """The sizes the kernels index with 32-bit integers (:data:`~.kernels.MAX_INDEX`),
    after the metadata checks: the coordinates of each cloud (``3 M`` and ``3 N``) and,
    for the aggregation, whose backward offsets rows by ``q * F`` and ``q * k``, ``M F``
    and ``M k``. On every device, so that CPU tensors and fakes fail as CUDA ones do."""
    check_index_limit("p_query", "queries", p_query.shape[0], MAX_INDEX // 3, _COORDS)
    check_index_limit("p_ref", "points", p_ref.shape[0], MAX_INDEX // 3, _COORDS)
    if feats is not None:
        m = p_query.shape[0]
        _check_backward_sizes(m, feats.shape[1], k, "p_query", "p_query")


def _search_args(p_query, p_ref, grid, cells):
    """The kernels' cloud and grid arguments: ``(query, order, ref, ref_index)`` and
    ``(start, lo, hi, cells)``."""
    if not grid:
        unused = p_query.new_empty(1)  # read only with GRID
        return (p_query, unused, p_ref, unused), (unused, unused, unused, 1)
    g = spatial.build(p_query, p_ref, cells)
    query = p_query[g.order]  # in cell order
    return (query, g.order, g.ref, g.ref_index), (g.start, g.lo, g.hi, g.cells)


def launch_knn(p_query, p_ref, k, grid=True, cells=None):
    """The search kernel through ``wrap_triton``, by the grid walk or by brute force
    (chapter 8): distances ``(M, k)`` float32 ascending and indices ``(M, k)`` int64,
    for float32 clouds ``(M, 3)`` and ``(N, 3)``, not checked. ``wrap_triton`` lets
    the compiler trace the launch inside :func:`knn_op`."""
    m, n = p_query.shape[0], p_ref.shape[0]
    distances = p_query.new_empty((m, k))
    indices = p_query.new_empty((m, k), dtype=torch.int64)
    clouds, cells_args = _search_args(p_query, p_ref, grid, cells)
    wrap_triton(knn_kernel)[(triton.cdiv(m, BLOCK_Q),)](
        *clouds,
        distances,
        indices,
        m,
        n,
        *cells_args,
        K=k,
        KP=next_power_of_2(k),
        BLOCK_Q=BLOCK_Q,
        BLOCK_R=BLOCK_R,
        GRID=grid,
        num_warps=NUM_WARPS,
    )
    return distances, indices


def search(p_query, p_ref, k, autotuned=False):
    """The grid-walk search launched as a plain Triton kernel: no operator, no
    ``wrap_triton``, as any PyTorch code may call one, compiled or not. With
    ``autotuned``, Triton's autotuner picks the queries per program and the warps."""
    m, n = p_query.shape[0], p_ref.shape[0]
    distances = p_query.new_empty((m, k))
    indices = p_query.new_empty((m, k), dtype=torch.int64)
    clouds, cells_args = _search_args(p_query, p_ref, True, None)
    args = (*clouds, distances, indices, m, n, *cells_args)
    meta = dict(K=k, KP=next_power_of_2(k), BLOCK_R=BLOCK_R, GRID=True)
    if autotuned:
        grid = lambda config: (triton.cdiv(m, config["BLOCK_Q"]),)  # noqa: E731
        knn_kernel_autotuned[grid](*args, **meta)
    else:
        grid = (triton.cdiv(m, BLOCK_Q),)
        knn_kernel[grid](*args, **meta, BLOCK_Q=BLOCK_Q, num_warps=NUM_WARPS)
    return distances, indices


@torch.library.triton_op("triton_knn::knn", mutates_args=())
def knn_op(
    p_query: torch.Tensor, p_ref: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact k nearest reference points of every query, by a Triton kernel.

    Args:
        p_query: ``(M, 3)`` float32, contiguous, finite.
        p_ref: ``(N, 3)`` float32, contiguous, finite, on the same device.
        k: ``1 <= k <= N``.

    Returns:
        distances ``(M, k)`` float32 ascending, indices ``(M, k)`` int64; fresh tensors,
        ready on PyTorch's current stream. No host synchronisation.
    """
    k = check_knn(p_query, p_ref, k)
    check_sizes(p_query, p_ref)
    if p_query.device.type != "cuda":
        # What the compiler traces for CPU tensors (eager CPU calls take the kernel
        # registered below): Triton compiles for GPUs only.
        return brute_force_knn(p_query, p_ref, k)
    return launch_knn(p_query, p_ref, k)


@knn_op.register_kernel("cpu")
def knn_cpu(p_query, p_ref, k):
    """The operator on CPU tensors: the brute force (chapter 8)."""
    k = check_knn(p_query, p_ref, k)
    check_sizes(p_query, p_ref)
    return brute_force_knn(p_query, p_ref, k)


@knn_op.register_fake
def knn_fake(p_query, p_ref, k):
    """Empty outputs of the right shapes, after the metadata checks (chapter 8)."""
    k = check_knn(p_query, p_ref, k, values=False)
    check_sizes(p_query, p_ref)
    m = p_query.shape[0]
    return p_query.new_empty((m, k)), p_query.new_empty((m, k), dtype=torch.int64)


# ---------------------------------------------------------------- fused kNN aggregation

BLOCK_F = 32
#: Queries per program of the gather alone.
GATHER_BLOCK_Q = 32


def _softmax_weights(distances: torch.Tensor, sigma: float) -> torch.Tensor:
    shifted = distances[:, :1] - distances  # <= 0: exp never overflows
    return torch.softmax(shifted / sigma, dim=1)


def launch_knn_aggregate(p_query, p_ref, feats, k, sigma, grid=True, cells=None):
    """The fused kernel through ``wrap_triton``, by the grid walk or by brute force
    (chapter 8): ``out`` ``(M, F)``, weights ``(M, k)`` float32 and indices ``(M, k)``
    int64, for float32 clouds and features ``(N, F)``, not checked."""
    m, n, f = p_query.shape[0], p_ref.shape[0], feats.shape[1]
    out = p_query.new_empty((m, f))
    weights = p_query.new_empty((m, k))
    indices = p_query.new_empty((m, k), dtype=torch.int64)
    clouds, cells_args = _search_args(p_query, p_ref, grid, cells)
    wrap_triton(knn_aggregate_kernel)[(triton.cdiv(m, BLOCK_Q),)](
        *clouds,
        feats,
        out,
        weights,
        indices,
        m,
        n,
        f,
        1.0 / sigma,
        *cells_args,
        K=k,
        KP=next_power_of_2(k),
        BLOCK_Q=BLOCK_Q,
        BLOCK_R=BLOCK_R,
        BLOCK_F=BLOCK_F,
        GRID=grid,
        num_warps=NUM_WARPS,
    )
    return out, weights, indices


@torch.library.triton_op("triton_knn::knn_aggregate_fwd", mutates_args=())
def knn_aggregate_fwd_op(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    k: int,
    sigma: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused search, softmax and gather by one Triton kernel.

    Returns:
        ``out`` ``(M, F)`` float32; and for the backward the weights ``(M, k)`` float32
        and indices ``(M, k)`` int64 of each query's neighbours (in no particular
        order).
    """
    k, sigma = check_knn_aggregate(p_query, p_ref, feats, k, sigma)
    check_sizes(p_query, p_ref, feats, k)
    if p_query.device.type != "cuda":  # traced for CPU tensors, as knn_op
        distances, indices = brute_force_knn(p_query, p_ref, k)
        weights = _softmax_weights(distances, sigma)
        out = torch_gather(weights, indices, feats)
        return out, weights, indices
    return launch_knn_aggregate(p_query, p_ref, feats, k, sigma)


@torch.library.triton_op("triton_knn::knn_aggregate_bwd", mutates_args=())
def knn_aggregate_bwd_op(
    grad_out: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, n_ref: int
) -> torch.Tensor:
    """The gather's adjoint: ``grad_feats[indices[q, j]] += weights[q, j] *
    grad_out[q]``; a fresh ``(n_ref, F)`` tensor."""
    m, f = grad_out.shape
    _check_backward_sizes(m, f, weights.shape[1])
    if grad_out.device.type != "cuda":
        return scatter(grad_out, weights, indices, n_ref)
    grad = grad_out.new_zeros((n_ref, f))
    alert_not_deterministic("triton_knn::knn_aggregate_bwd (atomic additions of rows)")
    wrap_triton(scatter_kernel)[(triton.cdiv(m, BLOCK_Q),)](
        grad_out,
        weights,
        indices,
        grad,
        m,
        f,
        K=weights.shape[1],
        BLOCK_Q=BLOCK_Q,
        BLOCK_F=BLOCK_F,
    )
    return grad


# The features' gradient by the scatter kernel, the clouds' through the weights
# (chapter 8); the search's distances differentiate with respect to both clouds.
positions.register_knn_aggregate_autograd(
    "triton_knn::knn_aggregate_fwd", torch.ops.triton_knn.knn_aggregate_bwd
)
positions.register_knn_autograd("triton_knn::knn")


def knn_aggregate(p_query, p_ref, feats, k, sigma):
    """The fused kNN aggregation, differentiable in ``feats``: ``(M, F)``."""
    return torch.ops.triton_knn.knn_aggregate_fwd(p_query, p_ref, feats, k, sigma)[0]


# ---------------------------------------------------------------- FLOP formulas

# Per (query, reference) pair the search does 3 subtractions, 3 multiplications and 2
# additions; the gather, 2 per (query, neighbour, feature). Without pruning, which
# skips some pairs: FlopCounterMode counts the work the brute force would do.
_PAIR_FLOPS = 8


@register_flop_formula(torch.ops.triton_knn.knn)
def _knn_flops(q_shape, r_shape, k, *args, out_shape=None, **kwargs) -> int:
    return _PAIR_FLOPS * q_shape[0] * r_shape[0]


@register_flop_formula(torch.ops.triton_knn.knn_aggregate_fwd)
def _knn_aggregate_flops(
    q_shape, r_shape, f_shape, k, sigma, *args, out_shape=None, **kwargs
) -> int:
    return _PAIR_FLOPS * q_shape[0] * r_shape[0] + 2 * q_shape[0] * k * f_shape[1]


def gather(
    weights: torch.Tensor, indices: torch.Tensor, feats: torch.Tensor
) -> torch.Tensor:
    """The aggregation's gather alone, ``out[q] = sum_j weights[q, j] *
    feats[indices[q, j]]``, by :func:`~.kernels.gather_kernel` (CUDA tensors, or
    Triton's interpreter): ``(M, F)``. Arguments as the search hands them over, not
    checked (chapter 10 times it beside the C++ and PTX gathers)."""
    m, k = weights.shape
    out = feats.new_empty((m, feats.shape[1]))
    gather_kernel[(triton.cdiv(m, GATHER_BLOCK_Q),)](
        weights,
        indices,
        feats,
        out,
        m,
        feats.shape[1],
        K=k,
        BLOCK_Q=GATHER_BLOCK_Q,
        BLOCK_F=BLOCK_F,
        num_warps=4,
    )
    return out
