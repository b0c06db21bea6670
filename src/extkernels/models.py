"""The running example (chapter 1): an MLP, an aggregation, and the ``Projector`` around
them.

``Projector(aggregation)`` lifts every reference point's 3 coordinates to ``hidden``
features, moves them onto the query points with ``aggregation`` and maps each query's
features to one output. The aggregation is a module holding only hyper-parameters and
the backend's name, so a chapter swaps the neighbour search without touching the model.
"""

from __future__ import annotations

import torch
from torch import nn

from .ops import knn_aggregate, radius_aggregate

__all__ = [
    "MLP",
    "KnnAggregation",
    "RadiusAggregation",
    "FixedGather",
    "Projector",
    "Shifted",
]


class MLP(nn.Sequential):
    """Three ``Linear`` layers with ReLU between: ``in_features -> hidden -> hidden ->
    out``."""

    def __init__(self, in_features: int, hidden: int, out_features: int):
        super().__init__(
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, out_features),
        )


class KnnAggregation(nn.Module):
    """Softmax-weighted mean of the features of the ``k`` nearest reference points."""

    def __init__(
        self, k: int = 7, sigma: float = 0.1, backend: str = "torch", **options
    ):
        super().__init__()
        self.k, self.sigma, self.backend, self.options = k, sigma, backend, options

    def forward(
        self, p_query: torch.Tensor, p_ref: torch.Tensor, feats: torch.Tensor
    ) -> torch.Tensor:
        return knn_aggregate(
            p_query,
            p_ref,
            feats,
            self.k,
            self.sigma,
            backend=self.backend,
            **self.options,
        )

    def extra_repr(self) -> str:
        return f"k={self.k}, sigma={self.sigma}, backend={self.backend!r}"


class RadiusAggregation(nn.Module):
    """Normalised ``exp(-distance / sigma)`` weights over the reference points within
    ``radius``."""

    def __init__(
        self, radius: float = 0.1, sigma: float = 0.1, backend: str = "torch", **options
    ):
        super().__init__()
        self.radius, self.sigma, self.backend, self.options = (
            radius,
            sigma,
            backend,
            options,
        )

    def forward(
        self, p_query: torch.Tensor, p_ref: torch.Tensor, feats: torch.Tensor
    ) -> torch.Tensor:
        return radius_aggregate(
            p_query,
            p_ref,
            feats,
            self.radius,
            self.sigma,
            backend=self.backend,
            **self.options,
        )

    def extra_repr(self) -> str:
        return f"radius={self.radius}, sigma={self.sigma}, backend={self.backend!r}"


class FixedGather(nn.Module):
    """Not an aggregation: each query takes the features of one reference point picked
    at random once. No neighbour search, no custom operator, the same shapes in and out;
    a projector built on it times what everything *but* the aggregation costs (the two
    MLPs, the loss, autograd and Adam), the floor under every real aggregation (chapter
    7)."""

    def __init__(self, n_query: int, n_ref: int, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer(
            "index", torch.randint(0, n_ref, (n_query,), generator=generator)
        )

    def forward(
        self, p_query: torch.Tensor, p_ref: torch.Tensor, feats: torch.Tensor
    ) -> torch.Tensor:
        return feats.index_select(0, self.index)


class Projector(nn.Module):
    """Features of a reference cloud, projected onto query points.

    Args:
        aggregation: module mapping ``(p_query (M, 3), p_ref (N, 3), feats (N,
            hidden))`` to ``(M, hidden)``.
        hidden: width of both MLPs.

    Shapes:
        ``forward(p_query (M, 3), p_ref (N, 3)) -> (M, 1)``, all float32.
    """

    def __init__(self, aggregation: nn.Module, hidden: int = 25):
        super().__init__()
        self.lift = MLP(3, hidden, hidden)
        self.aggregation = aggregation
        self.head = MLP(hidden, hidden, 1)

    def forward(self, p_query: torch.Tensor, p_ref: torch.Tensor) -> torch.Tensor:
        feats = self.lift(p_ref)
        return self.head(self.aggregation(p_query, p_ref, feats))


class Shifted(nn.Module):
    """``model`` with each cloud moved by a learned offset: ``model(p_query +
    query_shift, p_ref + ref_shift)``. Its loss depends on the positions themselves, so
    its training step differentiates the aggregation with respect to both clouds
    (chapter 6); the benchmark's ``+positions`` variants time that step.

    Shapes:
        ``forward(p_query (M, 3), p_ref (N, 3))`` as ``model``'s; both offsets ``(3,)``.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.query_shift = nn.Parameter(torch.zeros(3))
        self.ref_shift = nn.Parameter(torch.zeros(3))

    def forward(self, p_query: torch.Tensor, p_ref: torch.Tensor) -> torch.Tensor:
        return self.model(p_query + self.query_shift, p_ref + self.ref_shift)
