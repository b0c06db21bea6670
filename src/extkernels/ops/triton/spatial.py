"""The uniform grid of the grid walk (chapter 8): the reference cloud sorted by cell,
where each cell's points start, and the queries in cell order, all computed on the
device with no host synchronisation."""

from dataclasses import dataclass

import torch
import triton
from torch.library import wrap_triton

from .kernels import cell_keys_kernel

__all__ = ["Grid", "cells_per_axis", "cell_keys", "build"]

BLOCK = 1024  # points per program of the key kernel


def cells_per_axis(n_ref: int) -> int:
    """Cells along each axis of the reference cloud's box: about ``2.8 * n_ref^(1/3)``
    (at most 128), so that an evenly spread cloud has one point in about 20 cells and
    the book's Gaussian cloud about two per cell at its centre."""
    return max(1, min(128, round(2.8 * n_ref ** (1 / 3))))


def cell_keys(points, lo, hi, cells: int) -> torch.Tensor:
    """Each point's cell key (int32), in the grid of ``cells`` per axis over ``lo ..
    hi``."""
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
