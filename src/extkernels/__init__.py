"""Companion package of the book: external GPU kernels as PyTorch custom operators
(every chapter imports it; chapter 1 introduces it).

Organised by role: :mod:`~extkernels.problem` (device and sizes),
:mod:`~extkernels.data`, :mod:`~extkernels.models`, :mod:`~extkernels.ops` (one entry
point per operation, one backend per library), :mod:`~extkernels.timing`,
:mod:`~extkernels.profiling`, :mod:`~extkernels.plotting` and
:mod:`~extkernels.variants` (every version of the running example, as the benchmark
command runs them).
"""

from . import memory, reference
from .data import features, query_grid, reference_cloud, targets
from .models import (
    MLP,
    FixedGather,
    KnnAggregation,
    Projector,
    RadiusAggregation,
    Shifted,
)
from .ops import (
    backends,
    knn,
    knn_aggregate,
    knn_graph,
    radius_aggregate,
    radius_search,
)
from .problem import Problem, problem
from .training import train

__all__ = [
    "memory",
    "reference",
    "MLP",
    "FixedGather",
    "KnnAggregation",
    "Problem",
    "Projector",
    "Shifted",
    "RadiusAggregation",
    "backends",
    "features",
    "knn",
    "knn_aggregate",
    "knn_graph",
    "problem",
    "query_grid",
    "radius_aggregate",
    "radius_search",
    "reference_cloud",
    "targets",
    "train",
]

__version__ = "0.1.0"
