"""A PointNet++ set-abstraction layer and a small classifier on batches of clouds
(chapter 16), built on the package's :func:`~extkernels.ops.radius_search`.

:class:`SetAbstraction` follows Qi et al.'s layer (PointNet++, 2017): centres taken
from each cloud, each centre's neighbours within a radius, their positions relative to
the centre through a shared MLP, and a max over the neighbours. Two ways to hold the
neighbours:

- ``"csr"``: every neighbour (an edge list of data-dependent length), the max taken per
  centre with ``scatter_reduce``;
- ``"padded"``: at most ``max_neighbours`` per centre, the nearest (the paper's ball
  query keeps the first it finds), unused slots left out of the max.

The centres are every ``L / S``-th point of a cloud of ``L`` points (``S`` centres per
cloud): the points of a cloud are drawn independently, so that is a random subset, and
it takes tensor operations only (no host synchronisation). The paper takes them by
farthest-point sampling instead.

:class:`Classifier` is one layer, a max over each cloud's centres and an MLP to class
scores; :func:`fit` trains it on :class:`~extkernels.pointsets.PointSets`, and
:func:`time_steps` times its training step as chapter 1's protocol times the projector.
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import torch
from torch import nn

from .ops import radius_search
from .pointsets import PointSets
from .timing import time_blocks

__all__ = [
    "SetAbstraction",
    "Classifier",
    "centre_rows",
    "fit",
    "accuracy",
    "time_steps",
]

NEIGHBOURS = ("csr", "padded")


def centre_rows(offsets: torch.Tensor, n_centres: int) -> torch.Tensor:
    """``(B * n_centres,)`` int64 rows of the packed points: every ``L / n_centres``-th
    row of each cloud of ``L`` points (each cloud needs ``L >= n_centres`` for distinct
    centres), cloud by cloud."""
    lengths = offsets.diff()
    steps = torch.arange(n_centres, device=offsets.device)
    return (offsets[:-1, None] + steps * lengths[:, None] // n_centres).flatten()


def _mlp(widths: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class SetAbstraction(nn.Module):
    """``n_centres`` centres per cloud, each with the max of a shared MLP over its
    neighbours' positions relative to it (divided by ``radius``).

    Args:
        n_centres: centres per cloud.
        radius: the neighbourhood's radius.
        width: the MLP's width (three layers, ReLU between) and the output features.
        neighbours: ``"csr"`` or ``"padded"`` (see the module's docstring).
        max_neighbours: slots per centre of the padded form.
        backend: the radius search's backend (``ek.backends("radius_search")``).
    """

    def __init__(
        self,
        n_centres: int,
        radius: float,
        width: int,
        *,
        neighbours: str = "csr",
        max_neighbours: int = 32,
        backend: str = "torch",
    ):
        super().__init__()
        if neighbours not in NEIGHBOURS:
            raise ValueError(
                f"neighbours: expected one of {NEIGHBOURS}, got {neighbours!r}"
            )
        self.n_centres, self.radius, self.width = n_centres, radius, width
        self.neighbours, self.max_neighbours = neighbours, max_neighbours
        self.backend = backend
        self.mlp = _mlp([3, width, width, width])

    def forward(
        self, points: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``points`` ``(N, 3)``, ``offsets`` ``(B + 1,)``: the centres ``(B * S, 3)``
        and their features ``(B * S, width)``, cloud by cloud."""
        rows = centre_rows(offsets, self.n_centres)
        centres = points[rows]
        b = offsets.shape[0] - 1
        centre_offsets = torch.arange(b + 1, device=offsets.device) * self.n_centres
        batch = {
            "query_offsets": centre_offsets,
            "ref_offsets": offsets,
            "backend": self.backend,
        }
        if self.neighbours == "csr":
            nb_offsets, nb, _ = radius_search(centres, points, self.radius, **batch)
            owner = torch.repeat_interleave(
                torch.arange(rows.shape[0], device=rows.device),
                nb_offsets.diff(),
                output_size=nb.shape[0],
            )
            h = self.mlp((points[nb] - centres[owner]) / self.radius)
            index = owner[:, None].expand(-1, self.width)
            empty = h.new_zeros(rows.shape[0], self.width)
            return centres, empty.scatter_reduce(
                0, index, h, "amax", include_self=False
            )
        nb, _, _ = radius_search(
            centres, points, self.radius, max_neighbours=self.max_neighbours, **batch
        )
        h = self.mlp((points[nb.clamp_min(0)] - centres[:, None]) / self.radius)
        h = torch.where((nb >= 0)[..., None], h, -torch.inf)
        return centres, h.amax(dim=1)  # every centre is its own neighbour


class Classifier(nn.Module):
    """:class:`SetAbstraction`, a max over each cloud's centres, then an MLP to
    ``n_classes`` scores per cloud ``(B, n_classes)``."""

    def __init__(
        self,
        n_classes: int,
        n_centres: int = 32,
        radius: float = 0.2,
        width: int = 64,
        **options,
    ):
        super().__init__()
        self.layer = SetAbstraction(n_centres, radius, width, **options)
        self.head = _mlp([width, width, n_classes])

    def forward(self, points: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        _, feats = self.layer(points, offsets)
        per_cloud = feats.view(-1, self.layer.n_centres, self.layer.width).amax(dim=1)
        return self.head(per_cloud)


def _step(model: Callable, optimiser: torch.optim.Optimizer) -> Callable:
    """One training step of ``model`` on a batch: the cross-entropy, backward, a step
    of ``optimiser``; returns the loss (on the device, not read back)."""

    def step(points, offsets, labels) -> torch.Tensor:
        optimiser.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(points, offsets), labels)
        loss.backward()
        optimiser.step()
        return loss.detach()

    return step


def fit(
    model: nn.Module,
    sets: PointSets,
    steps: int,
    *,
    lr: float = 1e-3,
    compiled: Callable | None = None,
) -> list[float]:
    """Train ``model`` (called as ``compiled`` when given: the same parameters) with
    Adam and the cross-entropy on batches ``0 .. steps - 1`` of ``sets``; the loss of
    each step, read back once at the end."""
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    step = _step(model if compiled is None else compiled, optimiser)
    losses = [step(*sets.batch(i)) for i in range(steps)]
    return torch.stack(losses).tolist()


@torch.no_grad()
def accuracy(model: Callable, sets: PointSets, batches: range) -> float:
    """The share of clouds of ``batches`` of ``sets`` that ``model`` labels right."""
    right = total = 0
    for i in batches:
        points, offsets, labels = sets.batch(i)
        right += int((model(points, offsets).argmax(dim=1) == labels).sum())
        total += labels.numel()
    return right / total


def _timed(run: Callable, model: nn.Module, batch, n_iters: int, repeats: int):
    """``(forward, train step)``: :func:`~extkernels.timing.time_blocks` of each,
    after two warm-up calls of each."""
    points, offsets, labels = batch
    step = _step(run, torch.optim.Adam(model.parameters(), lr=1e-3))

    def forward():
        with torch.no_grad():
            return run(points, offsets)

    def train():
        return step(points, offsets, labels)

    for fn in (forward, train, forward, train):
        fn()
    return time_blocks(forward, n_iters, repeats), time_blocks(train, n_iters, repeats)


def time_steps(
    sets: PointSets,
    n_iters: int,
    repeats: int = 5,
    *,
    seed: int = 0,
    backends: tuple[str, ...] = ("torch",),
    **layer,
) -> pd.DataFrame:
    """Milliseconds of a forward pass (no gradients) and of a training step of the
    :class:`Classifier` (``layer``: its options) on batch 0 of ``sets``, eager and
    compiled with ``fullgraph=True``, for each radius search's backend of ``backends``
    and each way of holding the neighbours: median, fastest and slowest of ``repeats``
    blocks of ``n_iters`` calls."""
    batch = tuple(sets.batch(0))
    rows = []
    for backend in backends:
        for neighbours in NEIGHBOURS:
            for mode in ("eager", "compiled"):
                torch.manual_seed(seed)
                model = Classifier(
                    len(sets.classes), neighbours=neighbours, backend=backend, **layer
                )
                model = model.to(sets.device)
                if mode == "compiled":
                    # each model compiled afresh: every instance is a new guard on the
                    # same code, and eight would reach Dynamo's recompile limit
                    torch._dynamo.reset()
                run = model if mode == "eager" else torch.compile(model, fullgraph=True)
                fwd, train = _timed(run, model, batch, n_iters, repeats)
                rows.append((backend, neighbours, mode, "forward", *fwd))
                rows.append((backend, neighbours, mode, "train step", *train))
    index = ["backend", "neighbours", "mode", "pass"]
    columns = [*index, "median ms", "min ms", "max ms"]
    return pd.DataFrame(rows, columns=columns).set_index(index)
