"""The fused operators' Python half (chapter 11): the fakes and the autograd formulas
of operators whose schemas and kernels live in C++ (``csrc/``), registered right after
the library loads (:data:`~.build.on_load`); importing this module builds and loads
nothing.

The kNN aggregation's backward is chapter 9's scatter
(``extkernels_cpp::knn_aggregate_bwd``). The radius aggregation's forward returns,
beside its output, each query's total weight and the grid it built (sorted points,
cell starts and the grid's parameters as bytes); they are saved for the backward, which
walks the same grid without building it again, for the features' gradient and, when
the clouds require grad, for theirs (``extkernels_fused::radius_positions_bwd``).
"""

import functools

import torch

from .. import batches, checks, positions
from ..checks import (
    check_buffer,
    check_index_limit,
    check_knn,
    check_radius_aggregate,
)
from ..cpp import ops as cpp_ops
from ..neighbour_lists import check_radius_search, fake_csr, fake_padded
from ..torch import brute_force
from . import build
from .build import DEFAULT_INDEX, DEFAULT_LANES, INDEXES, LANES

__all__ = [
    "load",
    "grid_params_bytes",
    "cells_per_point",
    "max_queries",
    "max_radius_queries",
    "cell_capacity",
    "check_out",
    "check_queries",
    "check_knn_batched",
    "check_fused_radius_search",
]

_ops = torch.ops.extkernels_fused
on_load = build.on_load
on_load(lambda: checks.on_value_checks(_ops.set_value_checks))


@torch.compiler.assume_constant_result
def load() -> bool:
    """Build (or find in the cache) and load the library, chapter 9's first, and
    register both operators' Python halves, once per process: the backend calls it on
    first use. Run eagerly even while ``torch.compile`` traces a caller."""
    build.load()
    return True


@functools.cache
def _read() -> tuple[int, ...]:
    load()
    return (*(int(v) for v in _ops.grid_layout()), *(int(v) for v in _ops.limits()))


@torch.compiler.assume_constant_result
def grid_params_bytes() -> int:
    """Bytes of the grid's parameters (``GridParams`` in the C++ backend's
    ``grid.h``), read from the library (loaded if it is not yet)."""
    return _read()[0]


@torch.compiler.assume_constant_result
def cells_per_point() -> int:
    """The grid's cells per reference point, read from the library."""
    return _read()[1]


@torch.compiler.assume_constant_result
def max_queries() -> int:
    """The most queries of the kNN operators (the tree search lists query rows as
    32-bit integers), read from the library (``kMaxQueries`` in ``fused.h``). The
    reference cloud's is chapter 9's :func:`~extkernels.ops.cpp.ops.max_points`."""
    return _read()[2]


@torch.compiler.assume_constant_result
def max_radius_queries() -> int:
    """The most queries of the radius aggregation (its lists of query rows are stepped
    through by ``int``), read from the library (``kMaxRadiusQueries``)."""
    return _read()[3]


def cell_capacity(n: int) -> int:
    """Cells of the grid's workspace for a cloud of ``n`` points (``grid.h``'s
    ``cell_capacity``)."""
    return max(cells_per_point() * n, 1)


def check_queries(op: str, p_query) -> None:
    """At most :func:`max_queries` queries (``op`` ``"knn"`` or ``"knn_aggregate"``)
    or :func:`max_radius_queries` (``"radius_aggregate"``): run by the fakes and the
    backend's entry points (the CUDA operators check it too). The limit is the
    library's: a first call loads it."""
    if op == "radius_aggregate":
        limit = max_radius_queries()
        why = "the fused radius kernels list query rows, and step through the lists, "
        why += "with 32-bit integers"
    else:
        limit = max_queries()
        why = "the fused tree search lists query rows as 32-bit integers"
    check_index_limit("p_query", "queries", p_query.shape[0], limit, why)


def _check_index(index: str) -> str:
    if index not in INDEXES:
        raise ValueError(f'index: expected "tree" or "grid", got "{index}"')
    return index


def _check_lanes(lanes: int) -> int:
    if lanes not in LANES:
        built = ", ".join(str(n) for n in LANES[:-1]) + f" or {LANES[-1]}"
        raise ValueError(f"lanes: expected {built} threads per query, got {lanes}")
    return lanes


@on_load.register_fake("extkernels_fused::knn")
def knn_fake(p_query, p_ref, k, lanes=DEFAULT_LANES, index=DEFAULT_INDEX):
    out = cpp_ops.knn_fake(p_query, p_ref, k)  # chapter 9's checks and outputs
    check_queries("knn", p_query)
    _check_lanes(lanes)
    _check_index(index)
    return out


def check_out(p_query, k: int, distances, indices) -> None:
    """The buffers of ``knn_out``: ``(M, k)`` float32 distances and int64 indices,
    contiguous, on the clouds' device (its fake and its entry point check them)."""
    m = p_query.shape[0]
    check_buffer("distances", distances, (m, k), "M, k", torch.float32, p_query)
    check_buffer("indices", indices, (m, k), "M, k", torch.int64, p_query)


@on_load.register_fake("extkernels_fused::knn_out")
def _knn_out_fake(
    p_query, p_ref, k, distances, indices, lanes=DEFAULT_LANES, index=DEFAULT_INDEX
):
    knn_fake(p_query, p_ref, k, lanes, index)  # the search's own checks
    check_out(p_query, k, distances, indices)


@on_load.register_fake("extkernels_fused::knn_aggregate_fwd")
def _knn_aggregate_fwd_fake(
    p_query, p_ref, feats, k, sigma, lanes=DEFAULT_LANES, index=DEFAULT_INDEX
):
    _check_lanes(lanes)
    _check_index(index)
    out = cpp_ops.knn_aggregate_fwd_fake(p_query, p_ref, feats, k, sigma)
    check_queries("knn_aggregate", p_query)
    return out


@on_load.register_fake("extkernels_fused::knn_work")
def _knn_work_fake(p_query, p_ref, k, index=DEFAULT_INDEX):
    check_knn(p_query, p_ref, k, values=False)
    cpp_ops.check_max_points(p_ref)
    _check_index(index)
    return p_query.new_empty((p_query.shape[0], 2), dtype=torch.int64)


def check_knn_batched(p_query, p_ref, query_offsets, ref_offsets, k) -> int:
    """The metadata of ``knn_batched``'s arguments, as its C++ checks
    (``knn_batched.h``) see them: two clouds and two offsets on one device, as many
    clouds of queries as of reference points, ``1 <= k <=`` the kernels' most. Run by
    the fake and the entry point; returns ``k``. The offsets' values are the entry
    point's to check."""
    checks.check_cloud("p_query", p_query)
    checks.check_cloud("p_ref", p_ref)
    checks.check_same_device(p_query=p_query, p_ref=p_ref)
    cpp_ops.check_max_points(p_ref)
    batches.check_batch(
        query_offsets, ref_offsets, p_query.shape[0], p_ref.shape[0], values=False
    )
    checks.check_same_device(
        p_query=p_query, query_offsets=query_offsets, ref_offsets=ref_offsets
    )
    checks.check_contiguous("query_offsets", query_offsets)
    checks.check_contiguous("ref_offsets", ref_offsets)
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k: expected an int, got {type(k).__name__}")
    if not 1 <= k <= cpp_ops.max_k():
        raise ValueError(
            f"k: expected 1 <= k <= {cpp_ops.max_k()} (the C++ kernels keep at most "
            f"that many neighbours), got {k}"
        )
    return k


@on_load.register_fake("extkernels_fused::knn_batched")
def knn_batched_fake(p_query, p_ref, query_offsets, ref_offsets, k):
    k = check_knn_batched(p_query, p_ref, query_offsets, ref_offsets, k)
    m = p_query.shape[0]
    return p_query.new_empty((m, k)), p_query.new_empty((m, k), dtype=torch.int64)


# The forward returns chapter 9's (out, weights, indices): its backward is chapter 9's.
on_load(lambda: cpp_ops.register_knn_autograd("extkernels_fused::knn_aggregate_fwd"))
on_load(lambda: positions.register_knn_autograd("extkernels_fused::knn"))
# Its indices are rows of the whole p_ref: the same formula holds for a batch.
on_load(lambda: positions.register_knn_autograd("extkernels_fused::knn_batched"))


def check_fused_radius_search(
    p_query, p_ref, radius, max_neighbours, query_offsets, ref_offsets, values=None
):
    """The radius search's contract (:func:`~..neighbour_lists.check_radius_search`)
    on float32 clouds, the kernels' dtype, within their most points. Returns ``(radius,
    max_neighbours)``."""
    checked = check_radius_search(
        p_query,
        p_ref,
        radius,
        max_neighbours,
        query_offsets,
        ref_offsets,
        values=values,
        dtypes=(torch.float32,),
    )
    if p_ref.shape[0]:
        cpp_ops.check_max_points(p_ref)
    for name, t in (("query_offsets", query_offsets), ("ref_offsets", ref_offsets)):
        if t is not None:
            checks.check_contiguous(name, t)
    return checked


@on_load.register_fake("extkernels_fused::radius_search")
def _radius_search_fake(p_query, p_ref, radius, query_offsets=None, ref_offsets=None):
    check_fused_radius_search(
        p_query, p_ref, radius, None, query_offsets, ref_offsets, values=False
    )
    return fake_csr(p_query)


@on_load.register_fake("extkernels_fused::radius_search_padded")
def _radius_search_padded_fake(
    p_query, p_ref, radius, max_neighbours, query_offsets=None, ref_offsets=None
):
    _, k = check_fused_radius_search(
        p_query, p_ref, radius, max_neighbours, query_offsets, ref_offsets, values=False
    )
    return fake_padded(p_query, k)


on_load(
    lambda: positions.register_radius_search_autograd(
        "extkernels_fused::radius_search", "extkernels_fused::radius_search_padded"
    )
)


@on_load.register_fake("extkernels_fused::radius_aggregate_fwd")
def _radius_aggregate_fwd_fake(p_query, p_ref, feats, radius, sigma, warp=True):
    check_radius_aggregate(
        p_query,
        p_ref,
        feats,
        radius,
        sigma,
        values=False,
        feats_dtypes=cpp_ops.FEATS_DTYPES,
    )
    cpp_ops.check_max_points(p_ref)
    check_queries("radius_aggregate", p_query)
    m, n = p_query.shape[0], p_ref.shape[0]
    return (
        feats.new_empty((m, feats.shape[1])),
        p_query.new_empty((m,)),
        p_ref.new_empty((n, 4)),
        p_ref.new_empty((cell_capacity(n) + 1,), dtype=torch.int32),
        p_ref.new_empty((grid_params_bytes(),), dtype=torch.uint8),
    )


@on_load.register_fake("extkernels_fused::radius_aggregate_bwd")
def _radius_aggregate_bwd_fake(
    grad_out,
    p_query,
    totals,
    grid_ref,
    grid_start,
    grid_params,
    radius,
    sigma,
    warp=True,
):
    return grad_out.new_empty((grid_ref.shape[0], grad_out.shape[1]))


@on_load.register_fake("extkernels_fused::radius_positions_bwd")
def _radius_positions_bwd_fake(grad_out, out, feats, p_query, totals, grid_ref, *_):
    """``(grad_query (M, 3), grad_ref (N, 3))`` float32."""
    m, n = p_query.shape[0], grid_ref.shape[0]
    return p_query.new_empty((m, 3)), p_query.new_empty((n, 3))


def _radius_setup_context(ctx, inputs, output):
    p_query, p_ref, feats, radius, sigma, warp = inputs
    out, totals, grid_ref, grid_start, grid_params = output
    ctx.save_for_backward(
        p_query, p_ref, feats, out, totals, grid_ref, grid_start, grid_params
    )
    ctx.mark_non_differentiable(totals, grid_ref, grid_start, grid_params)
    ctx.radius, ctx.sigma, ctx.warp = radius, sigma, warp


def _radius_second_order(ctx, grad_out, p_query, p_ref, feats):
    """A backward that autograd records (``create_graph=True``): the kernels have no
    formula of their own, so the gradients come from the torch backend's, which can be
    differentiated again (its memory grows as ``M x N``, like that backend's)."""
    needs = ctx.needs_input_grad[:3]
    leaves = [t for t, need in zip((p_query, p_ref, feats), needs, strict=True) if need]
    out = brute_force.radius_aggregate(p_query, p_ref, feats, ctx.radius, ctx.sigma)
    grads = iter(torch.autograd.grad(out, leaves, grad_out, create_graph=True))
    return *(next(grads) if need else None for need in needs), None, None, None


def _radius_backward(ctx, grad_out, *_grad_saved):
    p_query, p_ref, feats, out, *grid = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if torch.is_grad_enabled() and any(needs[:3]):
        return _radius_second_order(ctx, grad_out, p_query, p_ref, feats)
    grad_out = grad_out.contiguous()
    grad_query = grad_ref = grad_feats = None
    if needs[2]:
        grad_feats = _ops.radius_aggregate_bwd(
            grad_out, p_query, *grid, ctx.radius, ctx.sigma, ctx.warp
        )
    if needs[0] or needs[1]:
        grad_query, grad_ref = _ops.radius_positions_bwd(
            grad_out, out, feats.contiguous(), p_query, *grid, ctx.radius, ctx.sigma
        )
        grad_query = grad_query if needs[0] else None
        grad_ref = grad_ref if needs[1] else None
    return grad_query, grad_ref, grad_feats, None, None, None


on_load.register_autograd(
    "extkernels_fused::radius_aggregate_fwd",
    _radius_backward,
    setup_context=_radius_setup_context,
)
