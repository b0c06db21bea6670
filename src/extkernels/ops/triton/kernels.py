"""Triton kernels of the exact kNN search (chapter 8).

One program takes ``BLOCK_Q`` queries and walks the reference cloud ``BLOCK_R`` points
at a time. Distances come from coordinate differences (never the expanded
``|a|^2 - 2 a.b + |b|^2``, which loses digits far from the origin, chapter 3), and the
``k`` best of each query stay on chip in a ``(BLOCK_Q, KP)`` tile: a new candidate
replaces the worst kept one when it is closer. No ``(M, N)`` matrix is ever written.
"""

import triton
import triton.language as tl

__all__ = [
    "knn_kernel",
    "knn_aggregate_kernel",
    "scatter_kernel",
    "next_power_of_2",
]

next_power_of_2 = triton.next_power_of_2


@triton.jit
def _merge_tile(
    qx,
    qy,
    qz,
    r_ptr,
    start,
    N,
    best_d,
    best_i,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The reference points ``start .. start + BLOCK_R`` merged into the kept lists."""
    cols = tl.arange(0, KP)[None, :]
    lanes = tl.arange(0, BLOCK_R)[None, :]
    r = start + tl.arange(0, BLOCK_R)
    r_in = r < N
    rx = tl.load(r_ptr + r * 3 + 0, mask=r_in, other=0.0)
    ry = tl.load(r_ptr + r * 3 + 1, mask=r_in, other=0.0)
    rz = tl.load(r_ptr + r * 3 + 2, mask=r_in, other=0.0)
    dx = qx[:, None] - rx[None, :]
    dy = qy[:, None] - ry[None, :]
    dz = qz[:, None] - rz[None, :]
    d = dx * dx + dy * dy + dz * dz
    d = tl.where(r_in[None, :], d, float("inf"))
    # At most K of this tile's points can enter a query's list: take the tile's nearest
    # K times, each time replacing the worst kept one if it is closer.
    for _ in tl.static_range(K):
        nearest = tl.min(d, axis=1)
        lane = tl.argmin(d, axis=1)
        worst = tl.max(best_d, axis=1)
        slot = tl.argmax(best_d, axis=1)
        replace = (cols == slot[:, None]) & (nearest < worst)[:, None]
        best_d = tl.where(replace, nearest[:, None], best_d)
        best_i = tl.where(replace, (start + lane)[:, None], best_i)
        d = tl.where(lanes == lane[:, None], float("inf"), d)
    return best_d, best_i


@triton.jit
def _nearest(
    q_ptr,
    r_ptr,
    q,
    q_in,
    N,
    lo_ptr,
    hi_ptr,
    start_ptr,
    count_ptr,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRUNE: tl.constexpr,
):
    """The K nearest reference points of the queries ``q``, unordered: squared
    distances ``(BLOCK_Q, KP)`` (columns >= K hold +inf) and their indices.

    With ``PRUNE``, the reference tiles are visited from this program's start tile
    (``start_ptr``) on, wrapping around, and a tile whose bounding box (``lo_ptr``,
    ``hi_ptr``: ``(T, 3)``) lies farther from the queries' box than every query's
    current K-th neighbour is skipped; the tiles visited are added to ``count_ptr``."""
    qx = tl.load(q_ptr + q * 3 + 0, mask=q_in, other=0.0)
    qy = tl.load(q_ptr + q * 3 + 1, mask=q_in, other=0.0)
    qz = tl.load(q_ptr + q * 3 + 2, mask=q_in, other=0.0)
    cols = tl.arange(0, KP)[None, :]
    # Padding columns hold -inf while searching: never the worst one, never replaced.
    best_d = tl.where(
        cols < K,
        tl.full((BLOCK_Q, KP), float("inf"), tl.float32),
        float("-inf"),
    )
    best_i = tl.full((BLOCK_Q, KP), 0, tl.int32)
    if PRUNE:
        big = float("inf")
        qlo_x = tl.min(tl.where(q_in, qx, big))
        qlo_y = tl.min(tl.where(q_in, qy, big))
        qlo_z = tl.min(tl.where(q_in, qz, big))
        qhi_x = tl.max(tl.where(q_in, qx, -big))
        qhi_y = tl.max(tl.where(q_in, qy, -big))
        qhi_z = tl.max(tl.where(q_in, qz, -big))
        n_tiles = tl.cdiv(N, BLOCK_R)
        first = tl.load(start_ptr + tl.program_id(0))
        visited = 0
        for s in range(0, n_tiles):
            t = (first + s) % n_tiles
            gx = tl.maximum(
                tl.maximum(
                    tl.load(lo_ptr + t * 3 + 0) - qhi_x,
                    qlo_x - tl.load(hi_ptr + t * 3 + 0),
                ),
                0.0,
            )
            gy = tl.maximum(
                tl.maximum(
                    tl.load(lo_ptr + t * 3 + 1) - qhi_y,
                    qlo_y - tl.load(hi_ptr + t * 3 + 1),
                ),
                0.0,
            )
            gz = tl.maximum(
                tl.maximum(
                    tl.load(lo_ptr + t * 3 + 2) - qhi_z,
                    qlo_z - tl.load(hi_ptr + t * 3 + 2),
                ),
                0.0,
            )
            # The farthest K-th neighbour among the tile's queries.
            worst = tl.max(tl.where(q_in, tl.max(best_d, axis=1), -big))
            if gx * gx + gy * gy + gz * gz < worst:
                best_d, best_i = _merge_tile(
                    qx, qy, qz, r_ptr, t * BLOCK_R, N, best_d, best_i, K, KP, BLOCK_R
                )
                visited += 1
        tl.atomic_add(count_ptr, visited)
    else:
        for start in range(0, N, BLOCK_R):
            best_d, best_i = _merge_tile(
                qx, qy, qz, r_ptr, start, N, best_d, best_i, K, KP, BLOCK_R
            )
    return tl.where(cols < K, best_d, float("inf")), best_i


@triton.jit
def knn_kernel(
    q_ptr,
    r_ptr,
    dist_ptr,
    idx_ptr,
    M,
    N,
    lo_ptr,
    hi_ptr,
    start_ptr,
    count_ptr,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRUNE: tl.constexpr = False,
):
    """Distances ``(M, K)`` ascending and indices ``(M, K)`` int64."""
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_in = q < M
    best_d, best_i = _nearest(
        q_ptr,
        r_ptr,
        q,
        q_in,
        N,
        lo_ptr,
        hi_ptr,
        start_ptr,
        count_ptr,
        K,
        KP,
        BLOCK_Q,
        BLOCK_R,
        PRUNE,
    )
    cols = tl.arange(0, KP)[None, :]
    # Written in ascending order: the nearest kept one, K times.
    for j in tl.static_range(K):
        nearest = tl.min(best_d, axis=1)
        slot = tl.argmin(best_d, axis=1)
        pick = cols == slot[:, None]
        index = tl.sum(tl.where(pick, best_i, 0), axis=1)
        tl.store(dist_ptr + q * K + j, tl.sqrt(nearest), mask=q_in)
        tl.store(idx_ptr + q * K + j, index.to(tl.int64), mask=q_in)
        best_d = tl.where(pick, float("inf"), best_d)


@triton.jit
def knn_aggregate_kernel(
    q_ptr,
    r_ptr,
    f_ptr,
    out_ptr,
    w_ptr,
    idx_ptr,
    M,
    N,
    F,
    inv_sigma,
    lo_ptr,
    hi_ptr,
    start_ptr,
    count_ptr,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
    PRUNE: tl.constexpr = False,
):
    """``out[q] = sum_j softmax_j(-d_qj / sigma) * feats[idx_qj]`` over the K nearest,
    in one pass: the search, the weights and the gather never leave the chip. Also
    writes the weights and indices ``(M, K)`` for the backward (in no particular
    order)."""
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_in = q < M
    best_d, best_i = _nearest(
        q_ptr,
        r_ptr,
        q,
        q_in,
        N,
        lo_ptr,
        hi_ptr,
        start_ptr,
        count_ptr,
        K,
        KP,
        BLOCK_Q,
        BLOCK_R,
        PRUNE,
    )
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
            ij = tl.sum(tl.where(pick, best_i, 0), axis=1)
            row = tl.load(f_ptr + ij[:, None] * F + f0 + fcols, mask=f_in, other=0.0)
            acc += wj[:, None] * row
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
