"""Triton kernels of the exact kNN search (chapter 8).

One program takes ``BLOCK_Q`` queries and walks the reference cloud ``BLOCK_R`` points
at a time. Distances come from coordinate differences (never the expanded
``|a|^2 - 2 a.b + |b|^2``, which loses digits far from the origin, chapter 3), and the
``k`` best of each query stay on chip in a ``(BLOCK_Q, KP)`` tile: a new candidate
replaces the worst kept one when it is closer. No ``(M, N)`` matrix is ever written.
"""

import triton
import triton.language as tl

__all__ = ["knn_kernel", "next_power_of_2"]

next_power_of_2 = triton.next_power_of_2


@triton.jit
def knn_kernel(
    q_ptr,
    r_ptr,
    dist_ptr,
    idx_ptr,
    M,
    N,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    q = pid * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_in = q < M
    qx = tl.load(q_ptr + q * 3 + 0, mask=q_in, other=0.0)
    qy = tl.load(q_ptr + q * 3 + 1, mask=q_in, other=0.0)
    qz = tl.load(q_ptr + q * 3 + 2, mask=q_in, other=0.0)

    cols = tl.arange(0, KP)[None, :]
    # The kept candidates, squared distances; padding columns (>= K) hold -inf so that
    # they are never the worst one and never replaced.
    best_d = tl.where(
        cols < K,
        tl.full((BLOCK_Q, KP), float("inf"), tl.float32),
        float("-inf"),
    )
    best_i = tl.full((BLOCK_Q, KP), 0, tl.int32)
    lanes = tl.arange(0, BLOCK_R)[None, :]

    for start in range(0, N, BLOCK_R):
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
        # At most K of this tile's points can enter a query's list: take the tile's
        # nearest K times, each time replacing the worst kept one if it is closer.
        for _ in tl.static_range(K):
            nearest = tl.min(d, axis=1)
            lane = tl.argmin(d, axis=1)
            worst = tl.max(best_d, axis=1)
            slot = tl.argmax(best_d, axis=1)
            replace = (cols == slot[:, None]) & (nearest < worst)[:, None]
            best_d = tl.where(replace, nearest[:, None], best_d)
            best_i = tl.where(replace, (start + lane)[:, None], best_i)
            d = tl.where(lanes == lane[:, None], float("inf"), d)

    # Written in ascending order: the nearest kept one, K times.
    best_d = tl.where(cols < K, best_d, float("inf"))
    for j in tl.static_range(K):
        nearest = tl.min(best_d, axis=1)
        slot = tl.argmin(best_d, axis=1)
        pick = cols == slot[:, None]
        index = tl.sum(tl.where(pick, best_i, 0), axis=1)
        tl.store(dist_ptr + q * K + j, tl.sqrt(nearest), mask=q_in)
        tl.store(idx_ptr + q * K + j, index.to(tl.int64), mask=q_in)
        best_d = tl.where(pick, float("inf"), best_d)
