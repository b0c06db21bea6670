"""Triton kernels of the exact kNN search and the fused kNN aggregation (chapter 8).

One program takes ``BLOCK_Q`` queries and keeps the ``k`` best of each on chip in a
``(BLOCK_Q, KP)`` tile (``KP``: ``k`` rounded up to a power of two): a candidate that
comes before a query's worst kept one replaces it (nearer, or as near with a lower row
of the reference cloud: ties go to the lowest index, on every backend). Distances come
from coordinate differences (never the expanded ``|a|^2 - 2 a.b + |b|^2``, which loses
digits far from the origin, chapter 3). No ``(M, N)`` matrix is ever written. Two walks
over the reference cloud:

- the **brute force** (``GRID=False``) compares every query with every reference point,
  ``BLOCK_R`` at a time;
- the **grid walk** (``GRID=True``) visits the 27 cells of a uniform grid around each
  query's cell, and is done when no other cell can hold a point closer than a query's
  k-th; a block of queries not done visits the 125 cells around, and a block still not
  done starts again by brute force, so the result is exact for any cloud.
"""

import triton
import triton.language as tl

from .lists import NO_POINT, rows_of, take_better, worst

__all__ = [
    "merge_tile",
    "cube",
    "grid_walk",
    "cell_keys_kernel",
    "knn_kernel",
    "knn_kernel_autotuned",
    "knn_aggregate_kernel",
    "scatter_kernel",
    "next_power_of_2",
    "MAX_INDEX",
]

next_power_of_2 = triton.next_power_of_2

#: The largest offset the kernels may compute: their row indices come from
#: ``tl.program_id`` and ``tl.arange``, 32-bit integers, and so do the offsets built
#: from them (``slot * 3`` and ``r * 3`` into the clouds, ``i * 3`` in
#: :func:`cell_keys_kernel`; ``q * F`` and ``q * K`` in :func:`scatter_kernel`, the
#: backward). The operators refuse sizes past it (``ops.check_sizes``).
MAX_INDEX = 2**31 - 1


@triton.jit
def _cell_size(lo_ptr, hi_ptr, G):
    """The grid's cubic cell: the widest side of the box ``lo .. hi`` over ``G``."""
    width = tl.maximum(
        tl.maximum(
            tl.load(hi_ptr + 0) - tl.load(lo_ptr + 0),
            tl.load(hi_ptr + 1) - tl.load(lo_ptr + 1),
        ),
        tl.load(hi_ptr + 2) - tl.load(lo_ptr + 2),
    )
    return tl.maximum(width / G, 1e-30)


@triton.jit
def _cell(x, lo, size, G):
    """The cell index of coordinate ``x`` along one axis, clamped to ``0 .. G - 1``."""
    return tl.minimum(tl.maximum(((x - lo) / size).to(tl.int32), 0), G - 1)


@triton.jit
def cell_keys_kernel(p_ptr, lo_ptr, hi_ptr, key_ptr, N, G, BLOCK: tl.constexpr):
    """Each point's cell as one int32 key, ``(x * G + y) * G + z`` (points outside the
    box ``lo .. hi`` fall in its border cells)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    i_in = i < N
    size = _cell_size(lo_ptr, hi_ptr, G)
    key = tl.zeros((BLOCK,), tl.int32)
    for axis in tl.static_range(3):
        x = tl.load(p_ptr + i * 3 + axis, mask=i_in, other=0.0)
        key = key * G + _cell(x, tl.load(lo_ptr + axis), size, G)
    tl.store(key_ptr + i, key, mask=i_in)


@triton.jit
def merge_tile(
    qx, qy, qz, r_ptr, index_ptr, start, N, best_d, best_i, cols,
    BLOCK_R: tl.constexpr, MAPPED: tl.constexpr,
):  # fmt: skip
    """The reference points ``start .. start + BLOCK_R`` into the kept lists (chapter
    8 shows it)."""
    r = start + tl.arange(0, BLOCK_R)
    r_in = r < N
    rx = tl.load(r_ptr + r * 3 + 0, mask=r_in, other=0.0)
    ry = tl.load(r_ptr + r * 3 + 1, mask=r_in, other=0.0)
    rz = tl.load(r_ptr + r * 3 + 2, mask=r_in, other=0.0)
    dx = qx[:, None] - rx[None, :]
    dy = qy[:, None] - ry[None, :]
    dz = qz[:, None] - rz[None, :]
    d = tl.where(r_in[None, :], dx * dx + dy * dy + dz * dz, float("inf"))
    # Only the tile's points that come before a query's worst kept one can enter its
    # list, at most K of them (KP bounds it): take the tile's first that many times.
    # Once the lists are good, most tiles need no round at all.
    worst_d, worst_i = worst(best_d, best_i)
    rows = rows_of(r[None, :], d, index_ptr, worst_d, MAPPED)
    return take_better(d, rows, worst_d, worst_i, best_d, best_i, cols)


@triton.jit
def _brute_force(
    qx, qy, qz, r_ptr, index_ptr, N, best_d, best_i, cols,
    BLOCK_R: tl.constexpr, MAPPED: tl.constexpr,
):  # fmt: skip
    for start in range(0, N, BLOCK_R):
        best_d, best_i = merge_tile(
            qx, qy, qz, r_ptr, index_ptr, start, N, best_d, best_i, cols, BLOCK_R,
            MAPPED,
        )  # fmt: skip
    return best_d, best_i


@triton.jit
def cube(
    qx, qy, qz, q_in, cx, cy, cz, r_ptr, index_ptr, start_ptr, G, best_d, best_i, cols,
    R: tl.constexpr, RUNS: tl.constexpr,
):  # fmt: skip
    """The points of the ``(2R + 1)^3`` cells around each query's cell into its list.
    Cells that differ in z only are neighbours in the sorted cloud, so the cube is
    ``(2R + 1)^2`` runs of consecutive points, one per lane (``RUNS``: a power of two,
    at least ``(2R + 1)^2``), read one point per run and step (chapter 8 shows it)."""
    side: tl.constexpr = 2 * R + 1
    run = tl.arange(0, RUNS)[None, :]
    nx = cx[:, None] + run // side - R
    ny = cy[:, None] + run % side - R
    ok = q_in[:, None] & (run < side * side) & (nx >= 0) & (nx < G) & (ny >= 0)
    ok = ok & (ny < G)
    column = (nx * G + ny) * G
    first = tl.load(
        start_ptr + column + tl.maximum(cz - R, 0)[:, None], mask=ok, other=0
    )
    end = tl.load(
        start_ptr + column + tl.minimum(cz + R, G - 1)[:, None] + 1, mask=ok, other=0
    )
    count = end - first
    for j in range(tl.max(count)):
        r = first + j
        r_in = j < count
        rx = tl.load(r_ptr + r * 3 + 0, mask=r_in, other=0.0)
        ry = tl.load(r_ptr + r * 3 + 1, mask=r_in, other=0.0)
        rz = tl.load(r_ptr + r * 3 + 2, mask=r_in, other=0.0)
        dx, dy, dz = qx[:, None] - rx, qy[:, None] - ry, qz[:, None] - rz
        d = tl.where(r_in, dx * dx + dy * dy + dz * dz, float("inf"))
        # As in merge_tile: only candidates before the worst kept one matter.
        worst_d, worst_i = worst(best_d, best_i)
        rows = rows_of(r, d, index_ptr, worst_d, True)
        best_d, best_i = take_better(d, rows, worst_d, worst_i, best_d, best_i, cols)
    return best_d, best_i


@triton.jit
def grid_walk(
    qx, qy, qz, q_in, r_ptr, index_ptr, start_ptr, lo_ptr, hi_ptr, G, empty, best_i,
    cols,
):  # fmt: skip
    """The cube of 27 cells around each query's cell, then (for a block not done) the
    cube of 125; returns the lists and whether every query of the block is done
    (chapter 8 shows it)."""
    size = _cell_size(lo_ptr, hi_ptr, G)
    lo_x, lo_y, lo_z = tl.load(lo_ptr + 0), tl.load(lo_ptr + 1), tl.load(lo_ptr + 2)
    cx, cy, cz = (
        _cell(qx, lo_x, size, G),
        _cell(qy, lo_y, size, G),
        _cell(qz, lo_z, size, G),
    )
    # How far the query lies inside its cell: a point outside the cube of radius R is
    # at least R * size + inside away (inside is 0 for a query outside the box).
    inside = tl.minimum(
        tl.minimum(
            tl.minimum(qx - (lo_x + cx * size), lo_x + (cx + 1) * size - qx),
            tl.minimum(qy - (lo_y + cy * size), lo_y + (cy + 1) * size - qy),
        ),
        tl.minimum(qz - (lo_z + cz * size), lo_z + (cz + 1) * size - qz),
    )
    inside = tl.maximum(inside, 0.0)
    best_d, best_i = cube(
        qx, qy, qz, q_in, cx, cy, cz, r_ptr, index_ptr, start_ptr, G, empty, best_i,
        cols, 1, 16,
    )  # fmt: skip
    # A point outside may tie with the worst kept one at the bound: not done then.
    bound = size + inside
    done = tl.max((q_in & (tl.max(best_d, axis=1) >= bound * bound)).to(tl.int32)) == 0
    if not done:  # again, from empty lists, with the larger cube
        best_d, best_i = cube(
            qx, qy, qz, q_in, cx, cy, cz, r_ptr, index_ptr, start_ptr, G, empty,
            tl.zeros_like(best_i), cols, 2, 32,
        )  # fmt: skip
        bound = 2 * size + inside
        open_ = q_in & (tl.max(best_d, axis=1) >= bound * bound)
        done = tl.max(open_.to(tl.int32)) == 0
    return best_d, best_i, done | (G <= 3)


@triton.jit
def _nearest(
    q_ptr, order_ptr, r_ptr, ref_index_ptr, M, N, start_ptr, lo_ptr, hi_ptr, G,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
    GRID: tl.constexpr,
):  # fmt: skip
    """This program's queries (rows ``q`` of the output, read through ``order_ptr``
    with ``GRID``) and their K nearest reference points, unordered: squared distances
    ``(BLOCK_Q, KP)`` (columns >= K hold +inf) and rows of the caller's cloud (with
    ``GRID`` ``r_ptr`` is sorted by cell, and ``ref_index_ptr`` maps it back)."""
    slot = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_in = slot < M
    # With GRID the queries come in cell order (neighbours in a block share cells), and
    # order_ptr holds each one's row in the caller's order.
    qx = tl.load(q_ptr + slot * 3 + 0, mask=q_in, other=0.0)
    qy = tl.load(q_ptr + slot * 3 + 1, mask=q_in, other=0.0)
    qz = tl.load(q_ptr + slot * 3 + 2, mask=q_in, other=0.0)
    if GRID:
        q = tl.load(order_ptr + slot, mask=q_in, other=0)
    else:
        q = slot
    cols = tl.arange(0, KP)[None, :]
    # Padding columns hold -inf while searching: never the worst one, never replaced.
    empty = tl.where(
        cols < K, tl.full((BLOCK_Q, KP), float("inf"), tl.float32), float("-inf")
    )
    best_d = empty
    best_i = tl.full((BLOCK_Q, KP), 0, tl.int32)
    if GRID:
        best_d, best_i, done = grid_walk(
            qx, qy, qz, q_in, r_ptr, ref_index_ptr, start_ptr, lo_ptr, hi_ptr, G,
            empty, best_i, cols,
        )  # fmt: skip
        if not done:  # a sparse or clustered cloud: start again, by brute force
            best_d, best_i = _brute_force(
                qx, qy, qz, r_ptr, ref_index_ptr, N, empty, tl.zeros_like(best_i),
                cols, BLOCK_R, True,
            )  # fmt: skip
    else:
        best_d, best_i = _brute_force(
            qx, qy, qz, r_ptr, ref_index_ptr, N, best_d, best_i, cols, BLOCK_R, False
        )
    return q, q_in, tl.where(cols < K, best_d, float("inf")), best_i


@triton.jit
def knn_kernel(
    q_ptr, order_ptr, r_ptr, ref_index_ptr, dist_ptr, idx_ptr, M, N, start_ptr,
    lo_ptr, hi_ptr, G,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
    GRID: tl.constexpr,
):  # fmt: skip
    """Distances ``(M, K)`` ascending and indices ``(M, K)`` int64 of the K nearest.
    With ``GRID`` the reference cloud ``r_ptr`` comes sorted by cell and
    ``ref_index_ptr`` maps its points back to the caller's."""
    q, q_in, best_d, best_i = _nearest(
        q_ptr, order_ptr, r_ptr, ref_index_ptr, M, N, start_ptr, lo_ptr, hi_ptr, G,
        K, KP, BLOCK_Q, BLOCK_R, GRID,
    )  # fmt: skip
    # In ascending order: the first kept one (nearest, then lowest row), K times.
    for j in tl.static_range(K):
        nearest = tl.min(best_d, axis=1)
        index = tl.min(tl.where(best_d == nearest[:, None], best_i, NO_POINT), axis=1)
        tl.store(dist_ptr + q * K + j, tl.sqrt(nearest), mask=q_in)
        tl.store(idx_ptr + q * K + j, index.to(tl.int64), mask=q_in)
        taken = (best_d == nearest[:, None]) & (best_i == index[:, None])
        best_d = tl.where(taken, float("inf"), best_d)


#: The search with its queries per program and warps chosen by Triton's autotuner,
#: once per distinct (M, N, K): launched without ``BLOCK_Q`` and ``num_warps``, and
#: with a grid that reads ``BLOCK_Q`` from the chosen configuration.
knn_kernel_autotuned = triton.autotune(
    configs=[
        triton.Config({"BLOCK_Q": block_q}, num_warps=warps)
        for block_q, warps in [(16, 1), (16, 2), (32, 1), (32, 2), (64, 2), (64, 4)]
    ],
    key=["M", "N", "K"],
)(knn_kernel)


@triton.jit
def knn_aggregate_kernel(
    q_ptr, order_ptr, r_ptr, ref_index_ptr, f_ptr, out_ptr, w_ptr, idx_ptr, M, N, F,
    inv_sigma, start_ptr, lo_ptr, hi_ptr, G,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr, GRID: tl.constexpr,
):  # fmt: skip
    """``out[q] = sum_j softmax_j(-d_qj / sigma) * feats[idx_qj]`` over the K nearest,
    in one pass: the search, the weights and the gather never leave the chip. Also
    writes the weights and indices ``(M, K)`` for the backward (in no particular
    order). Clouds as in :func:`knn_kernel`."""
    q, q_in, best_d, best_i = _nearest(
        q_ptr, order_ptr, r_ptr, ref_index_ptr, M, N, start_ptr, lo_ptr, hi_ptr, G,
        K, KP, BLOCK_Q, BLOCK_R, GRID,
    )  # fmt: skip
    cols = tl.arange(0, KP)[None, :]
    dist = tl.sqrt(best_d)
    # Softmax of -d / sigma, shifted by the nearest distance (exp never underflows).
    logits = (tl.min(dist, axis=1)[:, None] - dist) * inv_sigma
    e = tl.where(cols < K, tl.exp(logits), 0.0)
    w = e / tl.sum(e, axis=1)[:, None]
    kept = q_in[:, None] & (cols < K)
    tl.store(w_ptr + q[:, None] * K + cols, w, mask=kept)
    tl.store(idx_ptr + q[:, None] * K + cols, best_i.to(tl.int64), mask=kept)
    fcols = tl.arange(0, BLOCK_F)[None, :]
    for f0 in range(0, F, BLOCK_F):
        f_in = q_in[:, None] & (f0 + fcols < F)
        acc = tl.zeros((BLOCK_Q, BLOCK_F), tl.float32)
        for j in tl.static_range(K):
            pick = cols == j
            wj = tl.sum(tl.where(pick, w, 0.0), axis=1)
            ij = tl.sum(tl.where(pick, best_i, 0), axis=1).to(tl.int64)
            feat = tl.load(f_ptr + ij[:, None] * F + f0 + fcols, mask=f_in, other=0.0)
            acc += wj[:, None] * feat
        tl.store(out_ptr + q[:, None] * F + f0 + fcols, acc, mask=f_in)


@triton.jit
def scatter_kernel(
    g_ptr,
    w_ptr,
    idx_ptr,
    grad_ptr,
    M,
    F,
    K: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """The gather's adjoint: ``grad_feats[idx_qj] += w_qj * grad_out[q]``, with atomic
    additions (several queries share a neighbour)."""
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_in = q < M
    fcols = tl.arange(0, BLOCK_F)[None, :]
    for f0 in range(0, F, BLOCK_F):
        f_in = q_in[:, None] & (f0 + fcols < F)
        g = tl.load(g_ptr + q[:, None] * F + f0 + fcols, mask=f_in, other=0.0)
        for j in tl.static_range(K):
            wj = tl.load(w_ptr + q * K + j, mask=q_in, other=0.0)
            ij = tl.load(idx_ptr + q * K + j, mask=q_in, other=0)
            tl.atomic_add(
                grad_ptr + ij[:, None] * F + f0 + fcols, wj[:, None] * g, mask=f_in
            )


@triton.jit
def gather_kernel(
    w_ptr,
    idx_ptr,
    f_ptr,
    out_ptr,
    M,
    F,
    K: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """The aggregation's gather alone: ``out[q] = sum_j w_qj * feats[idx_qj]``, given
    the weights and indices (chapter 10 times it beside the C++ and PTX gathers)."""
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_in = q < M
    fcols = tl.arange(0, BLOCK_F)[None, :]
    for f0 in range(0, F, BLOCK_F):
        f_in = q_in[:, None] & (f0 + fcols < F)
        acc = tl.zeros((BLOCK_Q, BLOCK_F), tl.float32)
        for j in tl.static_range(K):
            wj = tl.load(w_ptr + q * K + j, mask=q_in, other=0.0)
            ij = tl.load(idx_ptr + q * K + j, mask=q_in, other=0)
            feat = tl.load(f_ptr + ij[:, None] * F + f0 + fcols, mask=f_in, other=0.0)
            acc += wj[:, None] * feat
        tl.store(out_ptr + q[:, None] * F + f0 + fcols, acc, mask=f_in)
