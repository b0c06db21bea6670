"""Who holds which rows, and the collectives that move them (chapter 13).

Two ways to cut ``n`` rows over ``world`` ranks:

- :func:`reference_rows`: a balanced split of the reference cloud (shard sizes differ by
  at most one), so that every rank holds at least one point when ``n >= world``;
- :func:`query_rows`: equal chunks of ``ceil(m / world)`` queries, the last ones short
  or empty, because a reduce-scatter hands every rank a chunk of the same size (the
  sums are padded to ``world`` chunks, then cut back).

The collectives are PyTorch's functional ones (the ``_c10d_functional`` operators behind
``torch.distributed._functional_collectives``): they return new tensors instead of
filling buffers, and ``torch.compile`` traces them into its graph. The reduce-scatter
gets its backward, an all-gather, from a ``torch.autograd.Function``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "Comm",
    "Rows",
    "reference_rows",
    "query_rows",
    "all_gather",
    "reduce_scatter_sum",
    "merge_topk",
    "to_query_rows",
]


# PyTorch's functional collectives, called as operators: the Python wrappers of
# ``torch.distributed._functional_collectives`` return an ``AsyncCollectiveTensor``,
# which sends every operation on it through Python (0.1-0.2 ms each in eager mode).
_c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class Comm:
    """A process group as the collectives take it: its size and its name, read once,
    outside any compiled code (constants for ``torch.compile``)."""

    world: int
    name: str

    @classmethod
    def of(cls, group=None) -> Comm:
        """The group's (default: every rank's)."""
        group = group or dist.group.WORLD
        return cls(dist.get_world_size(group), group.group_name)


def _gather(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    out = _c10d.all_gather_into_tensor(x.contiguous(), comm.world, comm.name)
    return _c10d.wait_tensor(out)


class _ReduceScatterSum(torch.autograd.Function):
    """Sum over ranks, this rank's chunk kept; the backward all-gathers the chunks'
    gradients (each rank's input reaches every chunk of the sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        out = _c10d.reduce_scatter_tensor(x.contiguous(), "sum", comm.world, comm.name)
        return _c10d.wait_tensor(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad, ctx.comm), None


@dataclass(frozen=True)
class Rows:
    """The rows ``[lo, hi)`` of ``n`` that one rank holds."""

    n: int
    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo

    def of(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor of ``n`` rows (a view, contiguous)."""
        if x.shape[0] != self.n:
            raise ValueError(f"x: expected {self.n} rows, got {x.shape[0]}")
        return x[self.lo : self.hi]


def _check_rank(world: int, rank: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank: expected 0 <= rank < world={world}, got {rank}")


def reference_rows(n: int, world: int, rank: int) -> Rows:
    """Rank ``rank``'s shard of a cloud of ``n`` points: a balanced split."""
    _check_rank(world, rank)
    if n < world:
        raise ValueError(
            f"p_ref: expected at least one point per rank ({world} ranks), got {n}"
        )
    return Rows(n, rank * n // world, (rank + 1) * n // world)


def query_rows(m: int, world: int, rank: int) -> Rows:
    """Rank ``rank``'s queries: chunk ``rank`` of ``ceil(m / world)`` rows."""
    _check_rank(world, rank)
    chunk = math.ceil(m / world)
    return Rows(m, min(rank * chunk, m), min((rank + 1) * chunk, m))


def all_gather(x: torch.Tensor, comm: Comm | None = None) -> torch.Tensor:
    """Every rank's ``x`` stacked along a new first dimension: ``(world, *x.shape)``.
    No gradient (the book gathers neighbour candidates, which carry none)."""
    comm = comm or Comm.of()
    return _gather(x, comm).view(comm.world, *x.shape)


def reduce_scatter_sum(x: torch.Tensor, comm: Comm | None = None) -> torch.Tensor:
    """The sum over ranks of ``x`` (``(world * c, ...)``), of which this rank keeps
    chunk ``rank`` (``(c, ...)``). Differentiable: its backward all-gathers the
    gradients."""
    return _ReduceScatterSum.apply(x, comm or Comm.of())


def merge_topk(
    distances: torch.Tensor, indices: torch.Tensor, k: int, comm: Comm | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact global k nearest from every rank's k nearest in its shard.

    A point among a query's k nearest of the whole cloud is among the k nearest of its
    own shard, so the k smallest of the ``world * k`` candidates are the answer.

    Args:
        distances: ``(M, k)`` this rank's candidates (``inf`` where its shard has fewer
            than ``k`` points).
        indices: ``(M, k)`` int64 rows of the *whole* cloud.

    Returns:
        distances ``(M, k)`` ascending, indices ``(M, k)``, the same on every rank.
    """
    comm, m = comm or Comm.of(), distances.shape[0]
    d = all_gather(distances, comm).permute(1, 0, 2).reshape(m, comm.world * k)
    i = all_gather(indices, comm).permute(1, 0, 2).reshape(m, comm.world * k)
    best = d.topk(k, dim=1, largest=False, sorted=True)
    return best.values, i.gather(1, best.indices)


def to_query_rows(
    partial: torch.Tensor, rows: Rows, comm: Comm | None = None
) -> torch.Tensor:
    """Sum every rank's ``partial`` (``(M, C)``, a row per query) and keep this rank's
    queries: ``(rows.size, C)``. Differentiable in ``partial``."""
    comm = comm or Comm.of()
    chunk = math.ceil(rows.n / comm.world)
    padded = F.pad(partial, (0, 0, 0, chunk * comm.world - rows.n))
    return reduce_scatter_sum(padded, comm)[: rows.size]
