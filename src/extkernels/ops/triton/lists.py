"""The kept lists of the Triton kernels (chapter 8): each query's ``k`` best
``(squared distance, row)`` pairs in a ``(BLOCK_Q, KP)`` tile, unordered. A candidate
enters in place of the worst kept pair when it comes before it: nearer, or as near with
a lower row of the caller's reference cloud, so that ties go to the lowest index, as on
every backend of the book.
"""

import triton
import triton.language as tl

__all__ = ["NO_POINT", "before", "merge_one", "rows_of", "take_better", "worst"]

#: The index of no point: larger than every row, so it loses every tie.
NO_POINT = tl.constexpr(2**31 - 1)


@triton.jit
def worst(best_d, best_i):
    """Each query's worst kept pair (the farthest, of equal ones the highest index):
    ``(distance, index)``."""
    worst_d = tl.max(best_d, axis=1)
    worst_i = tl.max(tl.where(best_d == worst_d[:, None], best_i, -1), axis=1)
    return worst_d, worst_i


@triton.jit
def before(d, i, worst_d, worst_i):
    """Whether ``(d, i)`` comes before ``(worst_d, worst_i)``: nearer, or as near with a
    lower index (ties go to the lowest reference index, on every backend)."""
    return (d < worst_d) | ((d == worst_d) & (i < worst_i))


@triton.jit
def merge_one(d, r, best_d, best_i, cols):
    """One candidate per query (distance ``d``, index ``r``) into the kept lists, in
    place of the worst kept one if it comes before it."""
    worst_d, worst_i = worst(best_d, best_i)
    slot = tl.argmax(tl.where(best_d == worst_d[:, None], best_i, -1), axis=1)
    replace = (cols == slot[:, None]) & before(d, r, worst_d, worst_i)[:, None]
    best_d = tl.where(replace, d[:, None], best_d)
    best_i = tl.where(replace, r[:, None], best_i)
    return best_d, best_i


@triton.jit
def rows_of(r, d, index_ptr, worst_d, MAPPED: tl.constexpr):
    """The rows in the caller's cloud of the candidates ``r`` (positions in ``r_ptr``,
    distances ``d``): through ``index_ptr`` when ``MAPPED`` (the cloud sorted by cell),
    read only for candidates as near as a query's worst kept one ``worst_d`` (the others
    cannot enter); :data:`NO_POINT` for no candidate."""
    near = d <= worst_d[:, None]
    if MAPPED:
        rows = tl.load(index_ptr + r, mask=near, other=NO_POINT).to(tl.int32)
    else:
        rows = tl.where(near, r, NO_POINT)
    return tl.where(d < float("inf"), rows, NO_POINT)


@triton.jit
def take_better(d, rows, worst_d, worst_i, best_d, best_i, cols):
    """The candidates ``(d, rows)`` ``(BLOCK_Q, C)`` that come before a query's worst
    kept one ``(worst_d, worst_i)`` into its list, the first (nearest, then lowest row)
    first."""
    better = before(d, rows, worst_d[:, None], worst_i[:, None])
    rounds = tl.minimum(tl.max(tl.sum(better.to(tl.int32), axis=1)), best_d.shape[1])
    for _ in range(rounds):
        first_d = tl.min(d, axis=1)
        first_i = tl.min(tl.where(d == first_d[:, None], rows, NO_POINT), axis=1)
        best_d, best_i = merge_one(first_d, first_i, best_d, best_i, cols)
        taken = (d == first_d[:, None]) & (rows == first_i[:, None])
        d = tl.where(taken, float("inf"), d)
    return best_d, best_i
