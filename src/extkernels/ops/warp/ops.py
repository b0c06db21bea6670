"""The warp backend's custom operators, each with its fake and its autograd (chapters
5-6).

- ``warp::radius_aggregate`` (:func:`radius_aggregate_op`): the forward; its backward
  calls
- ``warp::radius_aggregate_backward``: Warp's adjoint of the :data:`~.kernels.aggregate`
  kernel (``wp.launch(..., adjoint=True)``);
- ``warp::radius_aggregate_manual``: the same forward, its backward calling
- ``warp::radius_aggregate_backward_manual``: the hand-written
  :data:`~.kernels.scatter`. Both call :mod:`~.positions`'s operator when a cloud
  requires grad.

The module reads in the order of the recipe: each operator's ``custom_op`` (by
:func:`warp_op`), its ``register_fake`` right beneath it, then ``setup_context`` and
the ``register_autograd`` call that joins each forward to its backward
(:func:`attach_backward`). The backward is chosen by the operator's name, not by a
setting read by the autograd formula: such a setting would be read once, at trace time,
and compiled-graph caches (in memory and on disk) would not know about it.

Every operator and every fake checks its arguments by the one contract of
:mod:`~extkernels.ops.checks` (the fakes metadata only), so
``torch.compile(fullgraph=True)`` traces through them and fails at trace time on a bad
argument. The hash grid travels from forward to backward through :data:`~.grids.POOL`,
not through the operators' signatures.

**No hidden synchronisation.** Tensors reach Warp as kept descriptors over their own
memory; on CUDA the grid's build and the kernels run on PyTorch's current stream,
outputs and adjoint buffers are PyTorch tensors, and the host never waits for the
device, except for the check of finite coordinates (once per call, and off under
:func:`~extkernels.ops.checks.value_checks` ``(False)``). Because of that check and the
Python-side grid pool, the operators carry the ``cudagraph_unsafe`` tag: inductor's CUDA
graphs leave them out; :mod:`extkernels.graphs` captures them by hand.
"""

# No ``from __future__ import annotations``: torch.library reads the annotations as
# types.
import functools
from collections.abc import Callable
from typing import Any

import torch

from ..checks import alert_not_deterministic, check_grad_out, check_radius_aggregate
from ..registry import CUDAGRAPH_UNSAFE
from .grids import POOL, Entry, entry_key
from .interop import Where, descriptor, launch, where

#: Tags of every Warp operator: the kernels read rows densely, so inductor must hand
#: them contiguous tensors (a compiled MLP's output may otherwise arrive with padded
#: rows), and they keep state in Python between calls (no CUDA graph inside a compiled
#: region).
TAGS = (torch.Tag.needs_contiguous_strides, *CUDAGRAPH_UNSAFE)


def warp_op(name: str) -> Callable:
    """``torch.library.custom_op`` for the operator ``warp::<name>``, as every Warp
    operator is made: no argument mutated, the CPU and CUDA, :data:`TAGS`."""
    return torch.library.custom_op(
        f"warp::{name}", mutates_args=(), device_types=("cpu", "cuda"), tags=TAGS
    )


__all__ = [
    *("BACKWARDS", "new_entry", "launch_online", "forward", "forward_fake"),
    "warp_op",
    *("radius_aggregate_op", "radius_aggregate_manual_op", "backward_entry"),
    *("backward", "backward_fake", "radius_aggregate_backward_op"),
    *("radius_aggregate_backward_manual_op", "setup_context", "attach_backward"),
]

#: The backward implementations: Warp's adjoint of the forward kernel, or the
#: hand-written one.
BACKWARDS = ("adjoint", "manual")


@functools.cache
def kernels() -> Any:
    """The kernels module, imported (and Warp with it) on the first launch."""
    from . import kernels as module

    return module


def _threads(n_features: int) -> int:
    """Threads per query: one per CHUNK features."""
    return -(-n_features // kernels().CHUNK)


def new_entry(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    radius: float,
    at: Where,
    norms: torch.Tensor | None = None,
) -> Entry:
    """A grid over ``p_ref``, the descriptors of both clouds, and the per-query
    normalisers ``shift`` (``d0``) and ``inv_norm`` (``1 / sum_j exp((d0 - d_qj) /
    sigma)``): the rows of ``norms`` ``(2, M)``, or of a fresh tensor for a kernel to
    fill (chapters 5-6)."""
    wp = kernels().wp
    grid, grid_id = POOL.build(p_ref, radius, at)
    points = (descriptor(p_query, wp.vec3), descriptor(p_ref, wp.vec3))
    if norms is None:
        norms = torch.empty(
            (2, p_query.shape[0]), dtype=torch.float32, device=p_query.device
        )
    shift, inv_norm = norms  # one allocation, two contiguous rows
    norm_descs = (descriptor(shift), descriptor(inv_norm))
    return Entry(grid, grid_id, norms, norm_descs, points, at)


# ---------------------------------------------------------------- forward


def launch_online(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
) -> tuple[Entry, torch.Tensor]:
    """Check the arguments, build the grid, run the one-walk kernel; return the grid's
    entry (the kernel fills its normalisers) and the output ``(M, F)`` float32
    (chapter 5)."""
    radius, sigma = check_radius_aggregate(p_query, p_ref, feats, radius, sigma)
    at = where(p_ref.device)
    m, f = p_query.shape[0], feats.shape[1]
    entry = new_entry(p_query, p_ref, radius, at)
    out = torch.empty((m, f), dtype=torch.float32, device=p_query.device)
    args = [
        entry.grid_id,
        *entry.points,
        descriptor(feats),
        radius,
        sigma,
        descriptor(out),
    ]
    launch(kernels().aggregate_online, (m, _threads(f)), [*args, *entry.norm_descs], at)
    return entry, out


def forward(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
) -> torch.Tensor:
    """The real forward of both forward operators (chapter 5): launch the kernel, keep
    the grid and the normalisers in the pool for the backward."""
    entry, out = launch_online(p_query, p_ref, feats, radius, sigma)
    POOL.put(entry_key(p_query, p_ref, radius, sigma), entry)
    return out


@warp_op("radius_aggregate")
def radius_aggregate_op(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
) -> torch.Tensor:
    """Radius-bounded aggregation by Warp's hash grid, as a PyTorch operator.

    Args:
        p_query: ``(M, 3)`` float32, contiguous, finite.
        p_ref: ``(N, 3)`` float32, contiguous, finite, on the same device.
        feats: ``(N, F)`` float32, contiguous, on the same device.
        radius: neighbourhood radius, > 0 (also the grid's cell width).
        sigma: weight length scale, > 0.

    Returns:
        ``(M, F)`` float32:
        ``sum_j exp(-d_qj / sigma) / sum_j' exp(-d_qj' / sigma) * feats[j]`` over
        ``d_qj <= radius``, zeros for a query without neighbour; a fresh tensor, ready
        on PyTorch's current stream. Keeps the hash grid in the pool for the backward
        (Warp's adjoint, ``warp::radius_aggregate_backward``).
    """
    return forward(p_query, p_ref, feats, radius, sigma)


@warp_op("radius_aggregate_manual")
def radius_aggregate_manual_op(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
) -> torch.Tensor:
    """The forward of ``warp::radius_aggregate`` (same arguments, same result), whose
    backward is the hand-written kernel (``warp::radius_aggregate_backward_manual``)."""
    return forward(p_query, p_ref, feats, radius, sigma)


@radius_aggregate_manual_op.register_fake
@radius_aggregate_op.register_fake
def forward_fake(p_query, p_ref, feats, radius, sigma):
    """The forward operators' fake (chapter 5): the real operator's contract, metadata
    only, so a compiled caller fails at trace time; an empty ``(M, F)`` tensor."""
    check_radius_aggregate(p_query, p_ref, feats, radius, sigma, values=False)
    return p_query.new_empty((p_query.shape[0], feats.shape[1]))


# ---------------------------------------------------------------- backward


def backward_entry(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    radius: float,
    sigma: float,
    at: Where,
) -> Entry:
    """The grid and normalisers the forward left in the pool, taken out of it, or, when
    they are gone (evicted, or a cloud changed in place), built again."""
    entry = POOL.take(entry_key(p_query, p_ref, radius, sigma))
    if entry is None:
        entry = new_entry(p_query, p_ref, radius, at)
        args = [entry.grid_id, *entry.points, radius, sigma, *entry.norm_descs]
        launch(kernels().normaliser, (p_query.shape[0],), args, at)
    return entry


def backward(
    grad_out: torch.Tensor,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
    kind: str,
) -> torch.Tensor:
    """The real backward of both backward operators (chapter 6): ``grad_feats``
    ``(N, F)`` float32 from ``grad_out`` ``(M, F)``, by ``kind`` (one of
    :data:`BACKWARDS`), with the forward's grid taken out of the pool or built again."""
    if kind not in BACKWARDS:
        raise ValueError(f"kind: expected one of {BACKWARDS}, got {kind!r}")
    # Metadata only: the forward checked the values.
    radius, sigma = check_radius_aggregate(
        p_query, p_ref, feats, radius, sigma, values=False
    )
    check_grad_out(grad_out, p_query, feats)
    if p_ref.device.type == "cuda":  # Warp runs a CPU kernel's threads one by one
        alert_not_deterministic(
            f"warp::radius_aggregate ({kind} backward, atomic adds)"
        )
    kernel_module = kernels()
    m, f = grad_out.shape
    at = where(p_ref.device)
    entry = backward_entry(p_query, p_ref, radius, sigma, at)
    # Fresh zeros every call: both kernels accumulate into grad_feats.
    grad_feats = torch.zeros_like(feats)
    common = [entry.grid_id, *entry.points]
    if kind == "adjoint":
        # The adjoint of `aggregate`: the forward arguments again, then one adjoint per
        # argument. Only feats and out have one; None is a null array (no gradient
        # wanted) and 0.0 the adjoint of a float argument. The adjoint kernel replays
        # the forward, including the stores inside `store4` (a wp.func's stores are
        # replayed, a kernel's own are not), so `out` must be real memory: a scratch
        # tensor nobody reads.
        scratch = torch.empty_like(grad_out)
        launch(
            kernel_module.aggregate,
            (m, _threads(f)),
            [
                *common,
                descriptor(feats),
                *entry.norm_descs,
                radius,
                sigma,
                descriptor(scratch),
            ],
            at,
            adj_inputs=[0, None, None, descriptor(grad_feats), None, None, 0.0, 0.0]
            + [descriptor(grad_out)],
        )
    else:
        launch(
            kernel_module.scatter,
            (m, _threads(f)),
            [*common, *entry.norm_descs, radius, sigma]
            + [descriptor(grad_out), descriptor(grad_feats)],
            at,
        )
    POOL.release(entry)
    return grad_feats


@warp_op("radius_aggregate_backward")
def radius_aggregate_backward_op(
    grad_out: torch.Tensor,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
) -> torch.Tensor:
    """Gradient of ``warp::radius_aggregate`` w.r.t. ``feats``, by Warp's adjoint of the
    forward kernel (``adjoint=True``).

    Args:
        grad_out: ``(M, F)`` float32, contiguous: the gradient of the output.
        p_query, p_ref, feats, radius, sigma: the forward's arguments.

    Returns:
        ``(N, F)`` float32 ``grad_feats``, a fresh tensor. Takes the forward's hash grid
        out of the pool, or builds one.
    """
    return backward(grad_out, p_query, p_ref, feats, radius, sigma, "adjoint")


@warp_op("radius_aggregate_backward_manual")
def radius_aggregate_backward_manual_op(
    grad_out: torch.Tensor,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
) -> torch.Tensor:
    """Gradient of ``warp::radius_aggregate_manual`` w.r.t. ``feats``, by the
    hand-written scatter kernel (arguments and result as for
    ``warp::radius_aggregate_backward``)."""
    return backward(grad_out, p_query, p_ref, feats, radius, sigma, "manual")


@radius_aggregate_backward_manual_op.register_fake
@radius_aggregate_backward_op.register_fake
def backward_fake(grad_out, p_query, p_ref, feats, radius, sigma):
    """The backward operators' fake (chapter 6): their checks on metadata, and an empty
    ``(N, F)`` tensor like ``feats``."""
    check_radius_aggregate(p_query, p_ref, feats, radius, sigma, values=False)
    check_grad_out(grad_out, p_query, feats)
    return torch.empty_like(feats)


# ---------------------------------------------------------------- autograd


def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    """What both forward operators keep for their backward (chapter 6)."""
    p_query, p_ref, feats, radius, sigma = inputs
    # Tensors for the backward (the output for the clouds' gradient); the hash grid is
    # not among them (it waits in the pool).
    ctx.save_for_backward(p_query, p_ref, feats, output)
    ctx.radius, ctx.sigma = radius, sigma


def attach_backward(forward_op: Any, backward_op: Any) -> None:
    """Register the autograd of ``forward_op`` (chapter 6): :func:`setup_context`, and
    a formula that calls ``backward_op`` for the gradient of ``feats`` and
    ``warp::radius_aggregate_positions_backward`` for those of the clouds."""

    def formula(ctx, grad_out: torch.Tensor):
        p_query, p_ref, feats, out = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if torch.is_grad_enabled() and any(needs[:3]):
            raise RuntimeError(
                "radius_aggregate: backend 'warp' has no second-order gradient (its "
                "backward kernels have no formula of their own): use backend 'torch' "
                "or 'fused' for create_graph=True"
            )
        # The incoming gradient may be a broadcast view (the backward of a sum is an
        # expand).
        grad_out = grad_out.contiguous()
        grad_query = grad_ref = grad_feats = None
        if needs[0] or needs[1]:
            # First, so that the features' backward still finds the forward's grid.
            grad_query, grad_ref = torch.ops.warp.radius_aggregate_positions_backward(
                grad_out, out, p_query, p_ref, feats, ctx.radius, ctx.sigma, needs[2]
            )
            grad_query = grad_query if needs[0] else None
            grad_ref = grad_ref if needs[1] else None
        if needs[2]:
            grad_feats = backward_op(
                grad_out, p_query, p_ref, feats, ctx.radius, ctx.sigma
            )
        return grad_query, grad_ref, grad_feats, None, None

    torch.library.register_autograd(forward_op, formula, setup_context=setup_context)


attach_backward(radius_aggregate_op, radius_aggregate_backward_op)
attach_backward(radius_aggregate_manual_op, radius_aggregate_backward_manual_op)
