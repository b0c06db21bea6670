"""The projector with its reference cloud cut into shards, one per rank (chapter 13).

Every rank holds every query, a shard of the reference cloud and a copy of the two
MLPs. It lifts its own points, and then:

- **kNN**: it finds its shard's k nearest points of every query with one of the book's
  searches, :func:`~.shards.merge_topk` turns the ``world * k`` candidates into the
  exact global k nearest, and each rank sums the softmax-weighted features of the
  winners it holds (:func:`knn_partial`);
- **radius**: each rank sums ``exp(-distance / sigma)`` and the weighted features over
  its own neighbours (:func:`radius_partial`); the sums of all shards are the sums over
  the whole cloud, and their ratio is the aggregation.

A reduce-scatter then adds the ranks' partial sums and hands each rank the rows of its
own queries (:func:`~.shards.to_query_rows`), on which it runs the second MLP. Both
partial sums are differentiable in the features, and the reduce-scatter's backward
all-gathers the gradients, so autograd trains the lifting MLP across shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..models import MLP
from ..ops import checks, fused, knn, positions
from . import shards

__all__ = ["sharded_knn", "knn_partial", "radius_partial", "ShardedProjector"]


def sharded_knn(
    p_query: torch.Tensor,
    p_ref_local: torch.Tensor,
    k: int,
    rows: shards.Rows,
    *,
    backend: str = "fused",
    comm: shards.Comm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact k nearest points of the whole cloud, from a shard on every rank.

    Args:
        p_query: ``(M, 3)`` every query, the same on every rank.
        p_ref_local: ``(rows.size, 3)`` this rank's shard of the cloud.
        k: neighbours per query, ``1 <= k <= rows.n``.
        rows: where the shard sits in the whole cloud (:func:`~.shards.reference_rows`).
        backend: the search run on the shard (any backend of ``knn``).
        comm: the process group (default: every rank).

    Returns:
        distances ``(M, k)`` ascending and indices ``(M, k)`` into the whole cloud.
    """
    if p_ref_local.shape[0] != rows.size:
        raise ValueError(
            f"p_ref: expected this rank's {rows.size} points (rows {rows.lo} to "
            f"{rows.hi} of {rows.n}), got {p_ref_local.shape[0]}"
        )
    if not 1 <= k <= rows.n:
        raise ValueError(f"k: expected 1 <= k <= {rows.n} (the whole cloud), got {k}")
    kk = min(k, rows.size)  # a shard may hold fewer than k points
    d, i = knn(p_query, p_ref_local, kk, backend=backend)
    i = i + rows.lo
    if kk < k:
        d = torch.cat([d, d.new_full((d.shape[0], k - kk), torch.inf)], dim=1)
        i = torch.cat([i, i.new_full((i.shape[0], k - kk), -1)], dim=1)
    return shards.merge_topk(d, i, k, comm)


def knn_partial(
    distances: torch.Tensor,
    indices: torch.Tensor,
    feats_local: torch.Tensor,
    sigma: float,
    rows: shards.Rows,
) -> torch.Tensor:
    """This rank's share of the kNN aggregation: the softmax weights of the global k
    nearest (every rank computes all of them), times the features of the neighbours in
    its shard; zero for the others. ``(M, F)``, differentiable in ``feats_local``."""
    weights = torch.softmax(-distances / sigma, dim=1)
    mine = (indices >= rows.lo) & (indices < rows.hi)
    # A neighbour that another rank holds still gathers a row here, with weight 0. Each
    # points at a different row: were they all on row 0, the backward's scatter-add
    # would pile half of all the gradients onto that row, one after another.
    local = (indices - rows.lo) % rows.size
    weights = torch.where(mine, weights, 0.0)
    return (weights.unsqueeze(-1) * feats_local[local]).sum(dim=1)


def _radius_partial_torch(p_query, p_ref, feats, radius, sigma):
    # The totals carry no gradient (nor do the fused kernel's): clouds that ask are
    # refused, not left without one.
    needs = (positions.wants_grad(p_query), positions.wants_grad(p_ref))
    positions.refuse_position_grads("radius_partial", "torch", needs)
    with torch.no_grad():
        d = (p_query[:, None, :] - p_ref[None, :, :]).norm(dim=-1)
        w = torch.where(d <= radius, torch.exp(-d / sigma), 0.0).to(feats.dtype)
    return w @ feats, w.sum(dim=1)


def radius_partial(
    p_query: torch.Tensor,
    p_ref_local: torch.Tensor,
    feats_local: torch.Tensor,
    radius: float,
    sigma: float,
    *,
    backend: str = "fused",
) -> torch.Tensor:
    """This rank's unnormalised radius sums: ``(M, F + 1)``, the weighted features
    summed over the neighbours in its shard, then the sum of their weights
    ``exp(-distance / sigma)``. Differentiable in ``feats_local``.

    ``backend="fused"`` takes them from chapter 11's kernel (its output times its
    total weight); ``"torch"`` from a brute force (memory ``M x N``, for checks).
    """
    if backend == "fused":
        out, total = fused.radius_aggregate_with_totals(
            p_query, p_ref_local, feats_local, radius, sigma
        )
        weighted = out * total.unsqueeze(1)
    elif backend == "torch":
        radius, sigma = checks.check_radius_aggregate(
            p_query, p_ref_local, feats_local, radius, sigma
        )
        weighted, total = _radius_partial_torch(
            p_query, p_ref_local, feats_local, radius, sigma
        )
    else:
        raise ValueError(f"backend: expected 'fused' or 'torch', got {backend!r}")
    return torch.cat([weighted, total.unsqueeze(1)], dim=1)


class ShardedProjector(nn.Module):
    """The running example's projector over a reference cloud cut into shards.

    Args:
        workload: ``"knn"`` or ``"radius"``.
        n_ref: points of the whole cloud; rank ``r`` of the group holds
            :func:`~.shards.reference_rows` ``(n_ref, world, r)``.
        backend: the search (kNN) or the partial sums (radius) run on each shard.
        group: the process group (default: every rank).

    Shapes:
        ``forward(p_query (M, 3), p_ref_local (shard, 3)) -> (rows, 1)``, the outputs
        of this rank's queries, :func:`~.shards.query_rows` ``(M, world, rank)``.

    Its parameters are named as :class:`~extkernels.models.Projector`'s, so one's
    ``state_dict`` loads into the other.
    """

    def __init__(
        self,
        workload: str,
        n_ref: int,
        *,
        k: int = 7,
        sigma: float = 0.1,
        radius: float = 0.1,
        hidden: int = 25,
        backend: str = "fused",
        group=None,
    ):
        super().__init__()
        if workload not in ("knn", "radius"):
            raise ValueError(f"workload: expected 'knn' or 'radius', got {workload!r}")
        self.workload, self.k, self.sigma, self.radius = workload, k, sigma, radius
        group = group or dist.group.WORLD
        self.backend, self.comm = backend, shards.Comm.of(group)
        self.world, self.rank = self.comm.world, dist.get_rank(group)
        self.rows = shards.reference_rows(n_ref, self.world, self.rank)
        self.lift = MLP(3, hidden, hidden)
        self.head = MLP(hidden, hidden, 1)

    def query_rows(self, m: int) -> shards.Rows:
        """This rank's queries out of ``m``."""
        return shards.query_rows(m, self.world, self.rank)

    def forward(self, p_query: torch.Tensor, p_ref_local: torch.Tensor) -> torch.Tensor:
        feats = self.lift(p_ref_local)
        if self.workload == "knn":
            with torch.no_grad():
                d, i = sharded_knn(
                    p_query,
                    p_ref_local,
                    self.k,
                    self.rows,
                    backend=self.backend,
                    comm=self.comm,
                )
            partial = knn_partial(d, i, feats, self.sigma, self.rows)
        else:
            partial = radius_partial(
                p_query,
                p_ref_local,
                feats,
                self.radius,
                self.sigma,
                backend=self.backend,
            )
        mine = shards.to_query_rows(
            partial, self.query_rows(p_query.shape[0]), self.comm
        )
        if self.workload == "radius":
            total = mine[:, -1:]
            mine = torch.where(
                total > 0,
                mine[:, :-1] / total.clamp_min(torch.finfo(total.dtype).tiny),
                0.0,
            )
        return self.head(mine)

    def extra_repr(self) -> str:
        return (
            f"workload={self.workload!r}, backend={self.backend!r}, "
            f"rank={self.rank} of {self.world}, "
            f"points {self.rows.lo}:{self.rows.hi} of {self.rows.n}"
        )
