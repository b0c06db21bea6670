"""One rank's share of the running example, for each way of cutting it (chapter 13).

Layouts:

- ``single``: the whole projector on one device, no process group involved (the
  baseline);
- ``queries``: every rank holds the whole reference cloud and a slice of the queries;
  the model is the book's :class:`~extkernels.models.Projector` under
  ``DistributedDataParallel``, which averages the gradients;
- ``reference``: every rank holds a shard of the cloud and every query;
  :class:`~.ops.ShardedProjector` under ``DistributedDataParallel``.

Each rank's loss is its share of the global mean squared error: the sum of its squared
errors times ``world / M``. DDP averages the gradients over the ``world`` ranks, which
gives exactly the gradient of the mean over all ``M`` queries, however unevenly the
queries are split.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import data
from ..models import KnnAggregation, Projector, RadiusAggregation
from ..problem import Problem
from ..training import make_train_step
from . import shards
from .ops import ShardedProjector

__all__ = [
    "LAYOUTS",
    "Setup",
    "single_projector",
    "sharded_projector",
    "ddp",
    "make_setup",
]

LAYOUTS = ("single", "queries", "reference")


def single_projector(workload: str, prob: Problem, backend: str) -> Projector:
    """The book's projector of ``workload``, on the CPU, with the current seed's
    weights."""
    if workload == "knn":
        aggregation = KnnAggregation(prob.k, prob.sigma, backend=backend)
    elif workload == "radius":
        aggregation = RadiusAggregation(prob.radius, prob.sigma, backend=backend)
    else:
        raise ValueError(f"workload: expected 'knn' or 'radius', got {workload!r}")
    return Projector(aggregation, hidden=prob.hidden)


def sharded_projector(
    workload: str, n_ref: int, prob: Problem, backend: str, group=None
) -> ShardedProjector:
    """:class:`~.ops.ShardedProjector` of ``workload`` with ``prob``'s
    hyper-parameters, for this rank of ``group``."""
    return ShardedProjector(
        workload,
        n_ref,
        k=prob.k,
        sigma=prob.sigma,
        radius=prob.radius,
        hidden=prob.hidden,
        backend=backend,
        group=group,
    )


def ddp(module: nn.Module, device: torch.device, group=None) -> DDP:
    """``module`` under ``DistributedDataParallel`` on this rank's device."""
    ids = [device.index] if device.type == "cuda" else None
    return DDP(module, device_ids=ids, process_group=group)


@dataclass
class Setup:
    """What one rank runs: its model and its inputs.

    Attributes:
        model: what the rank calls (DDP-wrapped and compiled where asked).
        module: the bare projector inside it.
        p_query, p_ref: the rank's inputs (``queries``: a slice of the queries and the
            whole cloud; ``reference``: every query and a shard of the cloud).
        target: the targets of the rank's queries.
        rows: the rank's queries in the whole grid.
        world: ranks in the group.
    """

    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    module: nn.Module
    p_query: torch.Tensor
    p_ref: torch.Tensor
    target: torch.Tensor
    rows: shards.Rows
    world: int

    def forward(self) -> torch.Tensor:
        with torch.no_grad():
            return self.model(self.p_query, self.p_ref)

    def loss(self) -> torch.Tensor:
        """This rank's share of the global mean squared error."""
        out = self.model(self.p_query, self.p_ref)
        sse = F.mse_loss(out, self.target, reduction="sum")
        return sse * (self.world / self.rows.n)

    def train_step(self, lr: float = 1e-3) -> Callable[[], torch.Tensor]:
        """A closure doing one training step of :meth:`loss`
        (:func:`~extkernels.training.make_train_step`)."""
        return make_train_step(
            self.model,
            self.module.parameters(),
            self.p_query,
            self.p_ref,
            self.target,
            lr=lr,
            objective=self.loss,
        )


def make_setup(
    workload: str,
    layout: str,
    prob: Problem,
    *,
    device: torch.device,
    n_ref: int | None = None,
    backend: str = "fused",
    state: dict | None = None,
    compile: bool = False,
    group=None,
) -> Setup:
    """Build one rank's :class:`Setup` of ``workload`` in ``layout``.

    Args:
        prob: the sizes and hyper-parameters (``grid_side``, ``k``, ``radius``...).
        n_ref: points of the whole cloud (default: the workload's size in ``prob``).
        state: the projector's initial weights (a ``state_dict``); by default those of
            ``torch.manual_seed(prob.seed)``, the same on every rank.
        compile: ``torch.compile(fullgraph=True)`` the bare projector before DDP wraps
            it.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    n_ref = n_ref or prob.cloud_size(workload)
    if state is None:
        torch.manual_seed(prob.seed)
        state = single_projector(workload, prob, backend).state_dict()
    p_query = data.query_grid(prob.grid_side)
    p_ref = data.reference_cloud(n_ref, seed=prob.seed)
    target = data.targets(p_query.shape[0], seed=prob.seed)
    if layout == "single":
        world, rank = 1, 0
    else:
        group = group or dist.group.WORLD
        world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = shards.query_rows(p_query.shape[0], world, rank)
    if layout == "reference":
        module = sharded_projector(workload, n_ref, prob, backend, group)
        p_ref = module.rows.of(p_ref)
    else:
        module = single_projector(workload, prob, backend)
        if layout == "queries":
            p_query = rows.of(p_query)
    module.load_state_dict(copy.deepcopy(state))
    module.to(device)
    model = torch.compile(module, fullgraph=True) if compile else module
    if layout != "single":
        model = ddp(model, device, group)
    return Setup(
        model=model,
        module=module,
        p_query=p_query.to(device),
        p_ref=p_ref.contiguous().to(device),
        target=rows.of(target).to(device),
        rows=rows,
        world=world,
    )
