"""The brute force in plain PyTorch (chapter 1; compiled in chapter 2): the reference.

Every query is compared with every reference point, so time and memory grow as N x M:
the difference tensor alone is ``(M, N, 3)``. ``chunk_size`` processes the queries in
slices of that many rows to cap the memory at ``chunk_size x N``; ``None`` keeps the
single-shot form whose cost chapter 1 measures. These functions accept float64 too, for
gradient checks of other backends.

Both are differentiable in ``p_query`` and ``p_ref`` with the neighbours held fixed
(:mod:`~extkernels.ops.positions`), to any order: they are plain PyTorch. Neighbours at
equal distance are taken by the lowest reference index, as every backend of the book
takes them.

A batch of clouds (``query_offsets``, ``ref_offsets``, :mod:`~extkernels.ops.batches`)
is one masked brute force over the whole batch: the distance to a point of another
cloud is ``+inf`` (outside every radius), so each query finds its own cloud's points.
The clouds of the points come from the offsets by tensor operations, never by reading
them on the host, so the batched form compiles with ``fullgraph=True``. Its queries go
in slices of :data:`BATCH_CHUNK` pairs by default, since the batch's ``M x N`` pairs
are mostly masked ones. Compiled, the slices are unrolled: the graph holds one search
per slice and is compiled again when their number, ``ceil(M / (BATCH_CHUNK // N))``,
changes (Dynamo stops after eight; an exported program takes only its traced number).
A ``chunk_size`` of at least ``M`` keeps one graph for every size, at ``M x N`` memory;
the ``fused`` backend's batched operators keep one graph without it.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from ..batches import cloud_of
from ..capture import capturing
from ..checks import check_int
from ..positions import pairwise_distances, wants_grad, with_position_grads

__all__ = ["BATCH_CHUNK", "knn", "radius_aggregate"]

#: Pairs (queries x reference points) per slice of a batch's masked brute force when
#: no ``chunk_size`` is given.
BATCH_CHUNK = 1 << 22


def check_chunk_size(chunk_size: object) -> int:
    """``chunk_size`` of the brute-force searches: a positive number of queries."""
    chunk_size = check_int("chunk_size", chunk_size, "an int or None")
    if chunk_size < 1:
        raise ValueError(
            "chunk_size: expected a positive number of queries or None, got "
            f"{chunk_size}"
        )
    return chunk_size


def _chunks(p_query: torch.Tensor, chunk_size: int | None) -> tuple[torch.Tensor, ...]:
    if chunk_size is None:
        return (p_query,)
    return p_query.split(check_chunk_size(chunk_size))


def _batch_chunk(p_ref: torch.Tensor, chunk_size: int | None, offsets) -> int | None:
    if offsets is None or chunk_size is not None:
        return chunk_size
    return max(1, BATCH_CHUNK // p_ref.shape[0])


def _clouds(p_query, p_ref, query_offsets, ref_offsets, chunk_size):
    """The queries' slices and, for a batch, each slice's ``(m, N)`` mask of the pairs
    within one cloud (``None`` without offsets)."""
    queries = _chunks(p_query, chunk_size)
    if query_offsets is None:
        return [(q, None) for q in queries]
    ref_cloud = cloud_of(ref_offsets, p_ref.shape[0])
    query_cloud = cloud_of(query_offsets, p_query.shape[0]).split(
        [q.shape[0] for q in queries]
    )
    return [
        (q, c[:, None] == ref_cloud[None, :])
        for q, c in zip(queries, query_cloud, strict=True)
    ]


def _distances(p_query: torch.Tensor, p_ref: torch.Tensor) -> torch.Tensor:
    # The straightforward form: an (M, N, 3) difference, then its norm. torch.cdist
    # would be leaner, but this is the code the book starts from and the compiler fuses.
    # Differences of coordinates, not |a|^2 - 2 a.b + |b|^2, which loses digits far from
    # the origin.
    return (p_query[:, None, :] - p_ref[None, :, :]).norm(dim=-1)


def _nearest(d: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` smallest of each row of ``d`` ``(M, N)``, ascending, a tie taken by the
    lower column: ``(values, indices)``."""
    if d.dtype == torch.float64:  # gradient checks: small clouds, a stable sort
        values, indices = d.sort(dim=1, stable=True)
        return values[:, :k], indices[:, :k]
    # A distance is >= 0, so its float32 bits order as integers do: the bits above the
    # column make one unique int64 key per entry, and the smallest keys are the nearest
    # points, equal distances by the lower column. torch.topk's own order of ties is
    # unspecified.
    key = d.view(torch.int32).to(torch.int64)
    key <<= 32
    key |= torch.arange(d.shape[1], device=d.device)
    indices = key.topk(k, dim=1, largest=False).indices
    return d.gather(1, indices), indices


def _top(d: torch.Tensor, k: int):
    """The ``k + 1`` smallest of each row of ``d`` (``values, cols``, ascending, ties in
    ``topk``'s order) and whether any row's ``k``-th and ``(k+1)``-th are equal."""
    values, cols = d.topk(k + 1, dim=1, largest=False)
    return values, cols, (values[:, k - 1] == values[:, k]).any()


def _ordered(values: torch.Tensor, cols: torch.Tensor, k: int):
    """The first ``k`` of :func:`_top`'s ``(values, cols)``, equal values by the lower
    column."""
    values, cols = values[:, :k], cols[:, :k]
    by_col = cols.argsort(dim=1)
    values, cols = values.gather(1, by_col), cols.gather(1, by_col)
    by_value = values.argsort(dim=1, stable=True)
    return values.gather(1, by_value), cols.gather(1, by_value)


def _search(chunks, p_ref: torch.Tensor, k: int) -> list:
    """Each chunk's :func:`_nearest` at the cost of one ``topk`` of its distances.

    The order of ties matters only where the ``k``-th and the ``(k+1)``-th smallest
    distance of a row are equal: otherwise the ``k`` kept are the row's ``k`` smallest
    whatever ``topk`` did with ties, and sorting them by (distance, column) is cheap.
    Only a chunk with such a tie (a lattice, copies of a point) pays for the keys.
    Eager, one wait for the GPU reads every chunk's answer; compiled for a GPU, each
    chunk is a branch of the graph. Where nothing can be read or branched on (fake
    tensors, a CUDA graph's capture, a graph compiled for CPU tensors) every chunk
    takes the keys.
    """

    def distances(q, same):
        return _masked(_distances(q, p_ref), same)

    if p_ref.dtype == torch.float64 or k >= p_ref.shape[0] or not _readable(p_ref):
        return [_nearest(distances(q, same), k) for q, same in chunks]
    if torch.compiler.is_compiling():
        return [_branch(distances(q, same), k) for q, same in chunks]
    tops = [_top(distances(q, same), k) for q, same in chunks]
    tied = torch.stack([tie for *_, tie in tops]).tolist()
    return [
        _nearest(distances(q, same), k) if tie else _ordered(v, c, k)
        for (q, same), (v, c, _), tie in zip(chunks, tops, tied, strict=True)
    ]


def _branch(d: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_search` for one chunk of a compiled graph: the keys or the kept
    ``k``, a branch the device's answer picks."""
    values, cols, tied = _top(d, k)

    def keys(d, values, cols):
        return _nearest(d, k)

    def kept(d, values, cols):
        return _ordered(values, cols, k)

    return torch.cond(tied, keys, kept, (d, values, cols))


def _readable(t: torch.Tensor) -> bool:
    """Whether a value computed beside ``t`` can be read (or, compiling, branched on):
    not under fake tensors, on the meta device or in a CUDA graph's capture, nor in a
    graph compiled for CPU tensors (a Triton operator's trace where there is no GPU),
    where torch 2.13's Inductor fails on the branch under dynamic shapes and once
    another graph compiled in the process."""
    if torch.compiler.is_compiling():
        return t.device.type != "cpu"
    return not (is_fake(t) or t.device.type == "meta" or capturing())


def _masked(d: torch.Tensor, same: torch.Tensor | None) -> torch.Tensor:
    return d if same is None else d.masked_fill(~same, torch.inf)


def knn(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    k: int,
    *,
    chunk_size: int | None = None,
    query_offsets: torch.Tensor | None = None,
    ref_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """k nearest reference points of every query by brute force.

    Args:
        p_query: ``(M, 3)`` query points.
        p_ref: ``(N, 3)`` reference points.
        k: neighbours per query, ``1 <= k <= N``.
        chunk_size: queries per slice, or None for one slice (for a batch,
            :data:`BATCH_CHUNK` pairs).
        query_offsets, ref_offsets: a batch's offsets, or None; every cloud with
            queries holds at least ``k`` points (the entry point checks it).

    Returns:
        distances ``(M, k)`` ascending along each row, and indices ``(M, k)`` int64 into
        p_ref; the distances differentiable in both clouds.
    """
    chunk_size = _batch_chunk(p_ref, chunk_size, query_offsets)
    chunks = _clouds(p_query, p_ref, query_offsets, ref_offsets, chunk_size)
    with torch.no_grad():
        parts = _search(chunks, p_ref, k)
    if len(parts) == 1:
        distances, indices = parts[0]
    else:
        distances = torch.cat([p[0] for p in parts])
        indices = torch.cat([p[1] for p in parts])
    return with_position_grads(distances, p_query, p_ref, indices), indices


def radius_aggregate(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
    *,
    chunk_size: int | None = None,
    query_offsets: torch.Tensor | None = None,
    ref_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Radius-bounded aggregation of ``feats`` (N, F) onto the queries; returns ``(M,
    F)``.

    Weights ``exp(-distance / sigma)`` over the reference points within ``radius``,
    normalised per query; a query with no neighbour gets zeros. The gradient reaches
    ``feats`` through the final matrix product and, when they require grad, the clouds
    through the weights (the set of neighbours held fixed). With offsets, only the
    points of a query's own cloud are neighbours.
    """
    positions = wants_grad(p_query, p_ref)
    chunk_size = _batch_chunk(p_ref, chunk_size, query_offsets)
    out = []
    for q, same in _clouds(p_query, p_ref, query_offsets, ref_offsets, chunk_size):
        with torch.no_grad():
            d = _distances(q, p_ref)
            inside = d <= radius
            if same is not None:
                inside &= same
            # Shifting by each query's nearest in-radius distance cancels in the
            # normalisation and keeps exp() from underflowing when radius / sigma is
            # large.
            nearest = torch.where(inside, d, torch.inf).amin(dim=1, keepdim=True)
            nearest = torch.where(torch.isinf(nearest), 0.0, nearest)
        if positions:  # the same distances, now recorded by autograd
            d = pairwise_distances(q, p_ref)
        with torch.set_grad_enabled(positions):
            w = torch.where(inside, torch.exp((nearest - d) / sigma), 0.0).to(
                feats.dtype
            )
            # An empty neighbourhood has w == 0 everywhere, so dividing by tiny keeps it
            # at 0.
            w = w / w.sum(dim=1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
        out.append(w @ feats)
    return out[0] if len(out) == 1 else torch.cat(out)
