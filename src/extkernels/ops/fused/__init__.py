"""The ``fused`` backend (chapters 11 and 14): the fastest exact projectors of the book,
in CUDA C++, for both workloads.

- ``knn`` and ``knn_aggregate``: by default (``index="tree"``, chapter 14) a wide tree
  over the points in Morton order, searched by one warp per query, which stays fast on
  any geometry; with ``index="grid"`` (chapter 11) chapter 9's grid, built with fewer
  kernels, searched by a group of ``lanes`` threads per query (4 by default) that merge
  their lists with warp shuffles. Either way the softmax and the gather run in the
  search's kernel; the backward is chapter 9's scatter.
- ``radius_aggregate``: the same grid, walked over the cells that a query's ball
  overlaps by one warp per query (``warp=False``: one thread per (query, feature)); the
  forward hands the grid to the backward as outputs of the operator, so the backward
  does not build it again.
- ``radius_search`` (chapter 16): the same grid and walk, one thread per query, its
  neighbours in CSR form (a walk to count them, one copy of their total to the host, a
  walk to write them) or padded to the ``max_neighbours`` nearest (one walk, no copy);
  a batch of clouds shares one grid, each query skipping the other clouds' rows.

A batch of clouds (``query_offsets``, ``ref_offsets``) is one launch per operation:
``knn`` and ``knn_aggregate`` test every pair of each cloud (:func:`knn_batched`, then
the softmax and gather in PyTorch), which pays for clouds of a few thousand points and
not for clouds of tens of thousands (chapter 16 measures where); ``radius_aggregate``
is the CSR radius search, then :func:`~extkernels.ops.gather.csr_aggregate`.

On the CPU the kNN operators walk the same tree (or run chapter 9's kernels for the
grid: the lanes are a GPU matter) and the radius operators the same walk in C++. The
sources live in ``csrc/`` beside the C++ backend's headers, which they include; the
library is built just in time like chapter 9's (:mod:`~.build`), by :func:`load` on
first use, never on import.
"""

import torch

from .. import batches, checks, cpp, gather, positions
from ..registry import OPERATIONS, Backend, Book, register
from . import build, ops
from .build import DEFAULT_INDEX, DEFAULT_LANES, INDEXES, LANES
from .ops import load

__all__ = [
    "BACKEND",
    "DEFAULT_INDEX",
    "DEFAULT_LANES",
    "INDEXES",
    "LANES",
    "available",
    "knn_batched",
    "knn_out",
    "knn_work",
    "load",
    "prepare",
    "radius_aggregate_with_totals",
]


#: :func:`load`, by the name of the registry's hook (``Backend.prepare``).
prepare = load


def available() -> bool:
    """Chapter 9's requirements: a C++ compiler and ninja (and ``nvcc`` for CUDA)."""
    return cpp.available()


def _call(name, *args):
    load()
    return cpp.call(
        getattr(torch.ops.extkernels_fused, name),
        *args,
        switch=torch.ops.extkernels_fused.set_value_checks,
    )


def _check_queries(op: str, p_query) -> None:
    """The kernels' limit on the queries (:func:`~.ops.check_queries`), checked here
    as in the fakes, before the call (the CUDA operators check it again)."""
    ops.check_queries(op, p_query)


def _knn(
    p_query,
    p_ref,
    k,
    *,
    lanes: int = DEFAULT_LANES,
    index: str = DEFAULT_INDEX,
    query_offsets=None,
    ref_offsets=None,
):
    _check_queries("knn", p_query)
    if query_offsets is not None:  # checked by the entry point: one launch
        return _call("knn_batched", p_query, p_ref, query_offsets, ref_offsets, k)
    return _call("knn", p_query, p_ref, k, lanes, index)


def _knn_aggregate(
    p_query,
    p_ref,
    feats,
    k,
    sigma,
    *,
    lanes: int = DEFAULT_LANES,
    index: str = DEFAULT_INDEX,
    query_offsets=None,
    ref_offsets=None,
):
    _check_queries("knn_aggregate", p_query)
    if query_offsets is not None:
        d, i = _call("knn_batched", p_query, p_ref, query_offsets, ref_offsets, k)
        return gather.softmax_gather(d, i, feats, sigma)
    return _call("knn_aggregate_fwd", p_query, p_ref, feats, k, sigma, lanes, index)[0]


def knn_out(
    p_query,
    p_ref,
    k,
    distances,
    indices,
    *,
    lanes: int = DEFAULT_LANES,
    index: str = DEFAULT_INDEX,
) -> None:
    """The search of ``knn`` written into the caller's buffers: ``distances`` ``(M, k)``
    float32 and ``indices`` ``(M, k)`` int64 on the clouds' device (the operator
    ``extkernels_fused::knn_out``, which allocates nothing on the GPU)."""
    k = checks.check_knn(p_query, p_ref, k)
    ops.check_out(p_query, k, distances, indices)  # metadata only: loads nothing
    _check_queries("knn", p_query)
    _call("knn_out", p_query, p_ref, k, distances, indices, lanes, index)


def _radius_search(
    p_query, p_ref, radius, max_neighbours=None, query_offsets=None, ref_offsets=None
):
    """The backend's ``radius_search``: ``extkernels_fused::radius_search`` (CSR) or,
    with ``max_neighbours``, ``extkernels_fused::radius_search_padded``, in the entry
    point's order of outputs."""
    radius, k = ops.check_fused_radius_search(
        p_query, p_ref, radius, max_neighbours, query_offsets, ref_offsets
    )
    if k is None:
        distances, offsets, indices = _call(
            "radius_search", p_query, p_ref, radius, query_offsets, ref_offsets
        )
        return offsets, indices, distances
    distances, indices, counts = _call(
        "radius_search_padded", p_query, p_ref, radius, k, query_offsets, ref_offsets
    )
    return indices, distances, counts


def knn_batched(p_query, p_ref, query_offsets, ref_offsets, k):
    """The ``k`` nearest neighbours of each query among its own cloud's reference
    points, for a batch of clouds in one launch (the operator
    ``extkernels_fused::knn_batched``, every pair tested: for clouds of a few thousand
    points). The clouds are packed as in
    :mod:`~extkernels.ops.batches`: the queries of cloud ``b`` are the rows
    ``query_offsets[b]:query_offsets[b + 1]`` of ``p_query`` ``(M, 3)``, its reference
    points the rows ``ref_offsets[b]:ref_offsets[b + 1]`` of ``p_ref`` ``(N, 3)``.
    Returns distances ``(M, k)`` float32 ascending (not squared) and indices ``(M, k)``
    int64, rows of the whole ``p_ref``, ties to the lower row; the distances are
    differentiable in both clouds.

    Synchronisation: with the value checks on (eager mode, by default), the offsets are
    copied to the host once, in one copy, and checked there (every cloud with queries
    must hold at least ``k`` reference points: the error names the first that does not),
    with the coordinates' finite check, one more read; the operator then runs with its
    own checks off and reads nothing back. Compiled, the operator runs as it is and
    makes the same checks itself, with the same one copy. With the checks off (in a
    CUDA graph's capture, or under ``value_checks(False)``) nothing is read back at
    all, and a cloud of fewer than ``k`` points leaves its queries' last neighbours at
    distance infinity and row -1."""
    k = ops.check_knn_batched(p_query, p_ref, query_offsets, ref_offsets, k)
    _check_queries("knn", p_query)
    if checks.values_checked(p_query):
        both = torch.cat([query_offsets, ref_offsets]).cpu()  # the one copy
        query_host, ref_host = both.split([query_offsets.shape[0]] * 2)
        batches.check_batch(query_host, ref_host, p_query.shape[0], p_ref.shape[0])
        batches.check_clouds_hold(query_host, ref_host, k)
        checks.check_finite(True, p_query=p_query, p_ref=p_ref)
    args = (p_query, p_ref, query_offsets, ref_offsets, k)
    return checks.call_checked(_call, "knn_batched", *args)


def knn_work(p_query, p_ref, k, *, index: str = DEFAULT_INDEX) -> torch.Tensor:
    """What each query's search does, replayed on the CPU (chapter 14): ``(M, 2)``
    int64, the cells (``index="grid"``) or node boxes (``"tree"``) it looks into and
    the reference points whose distance it computes. The walks are the GPU kernels'
    (the grid's rings of chapter 9, the tree's nearest-box-first descent), so the work
    is the same wherever the tensors live; on the GPU a tree walk past 128 steps (64
    in a cloud of up to 2^18 points) is finished by a team of warps, each walking a
    share of the tree."""
    k = checks.check_knn(p_query, p_ref, k)
    return _call("knn_work", p_query.cpu(), p_ref.cpu(), k, index)


def _radius_aggregate(
    p_query,
    p_ref,
    feats,
    radius,
    sigma,
    *,
    warp: bool = True,
    query_offsets=None,
    ref_offsets=None,
):
    _check_queries("radius_aggregate", p_query)
    if query_offsets is not None:
        offsets, indices, distances = _radius_search(
            p_query, p_ref, radius, None, query_offsets, ref_offsets
        )
        return gather.csr_aggregate(offsets, indices, distances, feats, sigma)
    return _call("radius_aggregate_fwd", p_query, p_ref, feats, radius, sigma, warp)[0]


def radius_aggregate_with_totals(
    p_query, p_ref, feats, radius, sigma, *, warp: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The radius aggregation ``(M, F)`` and each query's total weight ``(M,)``, the
    sum of ``exp(-distance / sigma)`` over its neighbours (0 for none): ``out *
    total`` is the unnormalised sum, which shards of a cloud add up (chapter 13).
    Differentiable in ``feats``; the totals carry no gradient, so clouds that require
    grad are refused."""
    radius, sigma = checks.check_radius_aggregate(p_query, p_ref, feats, radius, sigma)
    needs = (positions.wants_grad(p_query), positions.wants_grad(p_ref))
    positions.refuse_position_grads("radius_aggregate_with_totals", "fused", needs)
    _check_queries("radius_aggregate", p_query)
    out, totals, *_ = checks.call_checked(
        _call, "radius_aggregate_fwd", p_query, p_ref, feats, radius, sigma, warp
    )
    return out, totals


def _library():
    return build.library_file()


def _advice(g) -> list:
    """Its rows of the guide (chapter 12), built with :mod:`extkernels.guide` (``g``):
    the tree for kNN, the grid where it falls off its cliff, the radius walk."""
    return [
        g.Advice(
            "kNN in a training loop, any cloud",
            "the fused operators (chapters 11 and 14), {registered}; the step in one "
            "CUDA graph",
            "knn/fused+graphs",
            "knn_aggregate",
            g.tree,
        ),
        g.Advice(
            "kNN on clouds known to be blobs",
            "the fused operators with index='grid' (chapter 11), {registered}",
            "knn/fused-grid+graphs",
            "knn_aggregate",
            lambda e: f"falls off a cliff: {g.worst(e, 'fused-grid')}",
        ),
        g.Advice(
            "Radius neighbourhoods",
            "the fused warp-per-query walk (chapter 11), {registered}, in one graph",
            "radius/fused+graphs",
            "radius_aggregate",
            lambda e: g.against_book_cloud(e, "fused-radius"),
        ),
    ]


def _elsewhere(v, workload: str, cloud: str, *, grid: bool = False):
    """The fused projector in one CUDA graph on another cloud (``name@cloud``), or with
    chapter 11's grid instead of the tree (chapter 14)."""
    suffix = "" if cloud == "normal" else f"@{cloud}"
    return v.Variant(
        f"{workload}/fused{'-grid' if grid else ''}+graphs{suffix}",
        workload,
        "fused",
        chapter=14,
        graphs=True,
        options={"index": "grid"} if grid else {},
        cloud=cloud,
    )


def _whole_step(v, workload: str) -> list:
    """Chapter 11's variants of a workload: eager, ``reduce-overhead``, the step in
    CUDA graphs, compiled inside them, and that step differentiated with respect to
    both clouds (chapter 6)."""
    name, one_graph = f"{workload}/fused", v.IN_ONE_GRAPH
    return [
        v.Variant(name, workload, "fused", chapter=11),
        v.compiled(f"{name}+reduce-overhead", "fused", 11, mode="reduce-overhead"),
        v.Variant(f"{name}+graphs", workload, "fused", chapter=11, graphs=True),
        v.compiled(
            f"{name}+compile+graphs", "fused", 11, graphs=True, inductor=one_graph
        ),
        v.compiled(
            f"{name}+compile+graphs+positions",
            "fused",
            11,
            graphs=True,
            inductor=one_graph,
            positions=True,
        ),
    ]


def _variants(v) -> list:
    """Its variants of the benchmark (chapters 11, 14 and 15), built with
    :mod:`extkernels.variants` (``v``)."""
    knn = [
        *_whole_step(v, "knn"),
        v.compiled(
            "knn/fused+compile+graphs+inductor-defaults", "fused", 11, graphs=True
        ),
        # On real CAD surfaces queried in the volume around them, and with chapter
        # 11's grid instead of the tree (chapter 14).
        _elsewhere(v, "knn", "panda"),
        _elsewhere(v, "knn", "spitfire"),
        _elsewhere(v, "knn", "normal", grid=True),
        _elsewhere(v, "knn", "panda", grid=True),
        # Shipped (chapter 15): the library built just in time on a first run, and the
        # projector compiled in this process against the same compiled into a package.
        v.Variant(
            "knn/fused+graphs+jit",
            "knn",
            "fused",
            chapter=15,
            graphs=True,
            isolated=True,
            jit=True,
        ),
        v.compiled("knn/fused+compile", "fused", 15),
        v.Variant("knn/fused+aoti", "knn", "fused", chapter=15, package=True),
    ]
    radius = [
        *_whole_step(v, "radius"),
        v.compiled("radius/fused+compile", "fused", 15),
        v.Variant("radius/fused+aoti", "radius", "fused", chapter=15, package=True),
        _elsewhere(v, "radius", "panda"),
        _elsewhere(v, "radius", "outlier"),
    ]
    return knn + radius


BACKEND = register(
    Backend(
        "fused",
        available=available,
        knn=_knn,
        knn_aggregate=_knn_aggregate,
        radius_aggregate=_radius_aggregate,
        radius_search=_radius_search,
        operators={
            "knn": "extkernels_fused::knn",
            "knn_aggregate": "extkernels_fused::knn_aggregate_fwd",
            "radius_aggregate": "extkernels_fused::radius_aggregate_fwd",
            "radius_search": "extkernels_fused::radius_search",
        },
        prepare=load,
        position_grads=(*OPERATIONS, "radius_search"),
        batched=OPERATIONS,
        library=_library,
        libraries=(*cpp.BACKEND.libraries, "fused"),  # its CPU kernels call chapter 9's
        book=Book(
            chapter=11,
            toolchain=cpp.BACKEND.toolchain,  # chapter 9's
            variants=lambda v: _variants(v),
            glossary={
                "fused": "the fused CUDA operators of chapter 11: search, softmax and "
                "gather in one kernel; for kNN on the tree of chapter 14",
                "fused-grid": "the fused kNN on chapter 11's grid instead of the tree "
                "(chapter 14)",
            },
            advice=lambda g: _advice(g),
            methods={"fused": {}, "fused-grid": {"index": "grid"}},
            shipped="knn",
        ),
    )
)
