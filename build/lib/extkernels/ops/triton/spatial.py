"""The uniform grid of the grid walk (chapter 8): the reference cloud sorted by cell,
where each cell's points start, and the queries in cell order, all computed on the
device with no host synchronisation."""

import os
from dataclasses import dataclass

import torch
import triton
from torch.library import wrap_triton

from .kernels import cell_keys_kernel

__all__ = ["Grid", "cells_per_axis", "cell_keys", "build", "walk_stats"]

BLOCK = 1024  # points per program of the key kernel


def cells_per_axis(n_ref: int) -> int:
    """Cells along each axis of the reference cloud's box: about ``2.8 * n_ref^(1/3)``
    (at most 128), so that an evenly spread cloud has one point in about 20 cells and
    the book's Gaussian cloud about two per cell at its centre."""
    return max(1, min(128, round(2.8 * n_ref ** (1 / 3))))


def _cell_size(lo, hi, cells: int) -> torch.Tensor:
    """The cubic cell, as the kernels compute it: the box's widest side over
    ``cells``."""
    return ((hi - lo).max() / cells).clamp_min(1e-30)


def _cells(points, lo, hi, cells: int) -> torch.Tensor:
    """Each point's cell along each axis, ``(n, 3)`` int64, as the kernels compute
    it."""
    size = _cell_size(lo, hi, cells)
    return ((points - lo) / size).to(torch.int32).clamp(0, cells - 1).long()


def cell_keys(points, lo, hi, cells: int) -> torch.Tensor:
    """Each point's cell key (int32), in the grid of ``cells`` per axis over ``lo ..
    hi``: by a Triton kernel on a GPU (or in Triton's interpreter), otherwise by
    the same arithmetic in PyTorch."""
    if points.device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        c = _cells(points, lo, hi, cells)
        return ((c[:, 0] * cells + c[:, 1]) * cells + c[:, 2]).to(torch.int32)
    n = points.shape[0]
    keys = points.new_empty(n, dtype=torch.int32)
    wrap_triton(cell_keys_kernel)[(triton.cdiv(n, BLOCK),)](
        points, lo, hi, keys, n, cells, BLOCK=BLOCK
    )
    return keys


@dataclass
class Grid:
    """What the grid walk reads: the reference points sorted by cell (``ref``) and
    their indices in the caller's cloud (``ref_index``, int64), the first sorted point
    of every cell (``start``, ``cells**3 + 1`` int32), the queries in cell order
    (``order``, int64), and the box ``lo .. hi``."""

    ref: torch.Tensor
    ref_index: torch.Tensor
    start: torch.Tensor
    order: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    cells: int


def build(p_query, p_ref, cells: int | None = None) -> Grid:
    cells = cells or cells_per_axis(p_ref.shape[0])
    lo, hi = torch.aminmax(p_ref, dim=0)
    keys, ref_index = cell_keys(p_ref, lo, hi, cells).sort()
    every = torch.arange(cells**3 + 1, dtype=torch.int32, device=p_ref.device)
    start = torch.searchsorted(keys, every, out_int32=True)
    order = cell_keys(p_query, lo, hi, cells).argsort()
    return Grid(p_ref[ref_index], ref_index, start, order, lo, hi, cells)


def walk_stats(p_query, p_ref, kth, cells: int | None = None, block_q: int = 16):
    """What the grid walk reads, block by block, without running it: how many blocks
    of ``block_q`` queries finish in the cube of 27 cells, in the cube of 125, or by
    brute force, and how many reference points a query examines on average.

    ``kth``: each query's exact k-th nearest distance ``(M,)``. A block finishes with a
    cube of radius R when every query's k-th neighbour lies closer than any point
    outside the cube can (``R * size`` plus the query's depth inside its cell), which
    is the kernel's own test; a block that needs the larger cube reads both, and one
    that falls to the brute force reads all three.
    """
    g = build(p_query, p_ref, cells)
    G, n = g.cells, p_ref.shape[0]
    q = p_query[g.order]
    size = _cell_size(g.lo, g.hi, G)
    c = _cells(q, g.lo, g.hi, G)
    cell_lo = g.lo + c * size
    inside = torch.minimum(q - cell_lo, cell_lo + size - q).amin(dim=1).clamp_min(0)
    start = g.start.long()
    blocks = torch.arange(q.shape[0], device=q.device) // block_q
    n_blocks = int(blocks[-1]) + 1

    def cube(r: int):
        """Points in each query's cube of radius ``r``, and whether its block is
        done."""
        span = torch.arange(-r, r + 1, device=q.device)
        nx = c[:, :1, None] + span[None, :, None]
        ny = c[:, 1:2, None] + span[None, None, :]
        ok = (nx >= 0) & (nx < G) & (ny >= 0) & (ny < G)
        column = (nx.clamp(0, G - 1) * G + ny.clamp(0, G - 1)) * G
        first = column + (c[:, 2] - r).clamp_min(0)[:, None, None]
        last = column + (c[:, 2] + r).clamp_max(G - 1)[:, None, None] + 1
        points = ((start[last] - start[first]) * ok).sum(dim=(1, 2))
        bound = r * size + inside
        not_done = (kth[g.order] > bound).to(torch.int64)
        open_ = torch.zeros(n_blocks, dtype=torch.int64, device=q.device)
        open_.index_add_(0, blocks, not_done)
        return points, open_ == 0

    points1, done1 = cube(1)
    points2, done2 = cube(2)
    done2 = done2 | done1 | (G <= 3)
    per_query = points1 + (~done1[blocks]) * points2 + (~done2[blocks]) * n
    return {
        "blocks": n_blocks,
        "done in 27 cells": int(done1.sum()),
        "done in 125 cells": int((done2 & ~done1).sum()),
        "brute force": int((~done2).sum()),
        "points examined per query": float(per_query.float().mean()),
        "share of the cloud examined": float(per_query.float().mean() / n),
    }
