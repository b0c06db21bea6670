"""The radius search of the torch backend: the brute force of chapter 1 over the radius
of chapter 5, as two custom operators with fakes, so that ``torch.compile`` (chapter
2) and ``torch.export`` take it whole.

- ``extkernels_torch::radius_search``: every neighbour, as CSR ``(distances (E,),
  offsets (M + 1,), indices (E,))``. Its output size ``E`` depends on the data: the fake
  sizes it with ``torch.library.get_ctx().new_dynamic_size()`` (an unbacked symbolic
  size), and the real implementation synchronises with the host once to learn it.
- ``extkernels_torch::radius_search_padded``: the ``K`` nearest neighbours within the
  radius, padded to ``(M, K)`` (distance +inf, index -1), and their counts: sizes known
  from the shapes, no synchronisation.

The operators return the distances first (the entry point reorders them): ``opcheck``'s
AOT test sums every output into the first one's dtype, which an int64 cannot hold.

Within each query, neighbours are sorted by distance, equal distances by the lower
reference index, as the backend's kNN takes them. Both operators work on the queries in
chunks, so that the ``(chunk, N)`` distances bound the memory, and their autograd
formulas give the distances' gradients with respect to both clouds with the neighbours
held fixed (:mod:`~extkernels.ops.positions`), from PyTorch operations that have fakes:
a compiled model that differentiates positions compiles with ``fullgraph=True``.
"""

from __future__ import annotations

import torch

from ..neighbour_lists import check_radius_search, fake_csr, fake_padded
from ..positions import register_radius_search_autograd
from .brute_force import _distances, _nearest, check_chunk_size

__all__ = ["radius_search", "CHUNK_PAIRS"]

#: Distances per chunk of queries when no ``chunk_size`` is given: 2**22 pairs, a
#: ``(chunk, N, 3)`` float32 difference of 48 MiB.
CHUNK_PAIRS = 2**22


def _chunk(m: int, n: int, chunk_size: int | None) -> int:
    if chunk_size is None:
        return max(1, CHUNK_PAIRS // max(n, 1))
    return check_chunk_size(chunk_size)


def _cloud_of(offsets: torch.Tensor | None, n: int, device) -> torch.Tensor | None:
    """The cloud of each of ``n`` packed points: ``b`` where ``offsets[b] <= i <
    offsets[b + 1]``."""
    if offsets is None:
        return None
    rows = torch.arange(n, device=device)
    return torch.searchsorted(offsets[1:], rows, right=True)


def _within(q, p_ref, radius, q_cloud, r_cloud) -> torch.Tensor:
    """``(c, N)`` distances of a chunk of queries, +inf beyond the radius or in another
    cloud."""
    d = _distances(q, p_ref)
    inside = d <= radius
    if q_cloud is not None:
        inside &= q_cloud[:, None] == r_cloud[None, :]
    return torch.where(inside, d, torch.inf)


def _setup(p_query, p_ref, query_offsets, ref_offsets, chunk_size):
    step = _chunk(p_query.shape[0], p_ref.shape[0], chunk_size)
    q_cloud = _cloud_of(query_offsets, p_query.shape[0], p_query.device)
    r_cloud = _cloud_of(ref_offsets, p_ref.shape[0], p_ref.device)
    starts = range(0, p_query.shape[0], step)
    return [
        (
            p_query[s : s + step],
            None if q_cloud is None else q_cloud[s : s + step],
        )
        for s in starts
    ], r_cloud


@torch.library.custom_op(
    "extkernels_torch::radius_search", mutates_args=(), device_types=("cpu", "cuda")
)
def radius_search_csr(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    radius: float,
    query_offsets: torch.Tensor | None = None,
    ref_offsets: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every reference point within ``radius`` (inclusive) of each query, as CSR.

    Two passes over the chunks: the first counts each query's neighbours, then one
    host synchronisation reads every chunk's total and largest count (a single copy of
    ``2 x chunks`` integers) to size ``E`` and each chunk's slice; the second sorts
    each chunk's nearest ``largest count`` and gathers the neighbours from them.
    """
    radius, _ = check_radius_search(
        p_query, p_ref, radius, None, query_offsets, ref_offsets
    )
    chunks, r_cloud = _setup(p_query, p_ref, query_offsets, ref_offsets, chunk_size)
    counts = [
        (_within(q, p_ref, radius, c, r_cloud) < torch.inf).sum(1) for q, c in chunks
    ]
    zero = p_query.new_zeros(1, dtype=torch.int64)
    if not chunks:
        return p_query.new_empty(0), zero, zero[:0].clone()
    offsets = torch.cat([zero, torch.cat(counts).cumsum(0)])
    # The one synchronisation: every chunk's total and largest count, in one copy.
    sizes = torch.stack([torch.stack([n.sum(), n.max()]) for n in counts]).tolist()
    indices, distances = [], []
    for (q, c), n, (total, largest) in zip(chunks, counts, sizes, strict=True):
        if total == 0:
            continue
        values, cols = _nearest(_within(q, p_ref, radius, c, r_cloud), largest)
        rows = torch.repeat_interleave(
            torch.arange(len(n), device=n.device), n, output_size=total
        )
        rank = torch.arange(total, device=n.device) - (n.cumsum(0) - n)[rows]
        indices.append(cols[rows, rank])
        distances.append(values[rows, rank])
    if not indices:
        return p_query.new_empty(0), offsets, offsets[:0].clone()
    return torch.cat(distances), offsets, torch.cat(indices)


@radius_search_csr.register_fake
def _(p_query, p_ref, radius, query_offsets=None, ref_offsets=None, chunk_size=None):
    check_radius_search(
        p_query, p_ref, radius, None, query_offsets, ref_offsets, values=False
    )
    return fake_csr(p_query)


@torch.library.custom_op(
    "extkernels_torch::radius_search_padded",
    mutates_args=(),
    device_types=("cpu", "cuda"),
)
def radius_search_padded(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    radius: float,
    max_neighbours: int,
    query_offsets: torch.Tensor | None = None,
    ref_offsets: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``max_neighbours`` nearest reference points within ``radius`` of each
    query: ``distances (M, K)`` (+inf in unused slots), ``indices (M, K)`` (-1 there),
    ``counts (M,)`` (how many slots are used)."""
    radius, k = check_radius_search(
        p_query, p_ref, radius, max_neighbours, query_offsets, ref_offsets
    )
    chunks, r_cloud = _setup(p_query, p_ref, query_offsets, ref_offsets, chunk_size)
    m, n = p_query.shape[0], p_ref.shape[0]
    indices = p_query.new_full((m, k), -1, dtype=torch.int64)
    distances = p_query.new_full((m, k), torch.inf)
    if n:
        start, found = 0, min(k, n)
        for q, c in chunks:
            values, cols = _nearest(_within(q, p_ref, radius, c, r_cloud), found)
            rows = slice(start, start + q.shape[0])
            distances[rows, :found] = values
            indices[rows, :found] = torch.where(values < torch.inf, cols, -1)
            start += q.shape[0]
    return distances, indices, (indices >= 0).sum(1)


@radius_search_padded.register_fake
def _(
    p_query,
    p_ref,
    radius,
    max_neighbours,
    query_offsets=None,
    ref_offsets=None,
    chunk_size=None,
):
    _, k = check_radius_search(
        p_query, p_ref, radius, max_neighbours, query_offsets, ref_offsets, values=False
    )
    return fake_padded(p_query, k)


register_radius_search_autograd(
    "extkernels_torch::radius_search", "extkernels_torch::radius_search_padded"
)


def radius_search(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    radius: float,
    max_neighbours: int | None = None,
    query_offsets: torch.Tensor | None = None,
    ref_offsets: torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backend's ``radius_search``: the CSR operator, or the padded one when
    ``max_neighbours`` is given. ``chunk_size``: queries per chunk (default: as many
    as make :data:`CHUNK_PAIRS` distances)."""
    if max_neighbours is None:
        distances, offsets, indices = radius_search_csr(
            p_query, p_ref, radius, query_offsets, ref_offsets, chunk_size
        )
        return offsets, indices, distances
    distances, indices, counts = radius_search_padded(
        p_query, p_ref, radius, max_neighbours, query_offsets, ref_offsets, chunk_size
    )
    return indices, distances, counts
