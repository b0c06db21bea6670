"""The ``cuml`` backend: RAPIDS cuML's nearest-neighbour search (chapter 3), CUDA only.

The backend registers only its search; ``knn_aggregate`` is the registry's derived one,
with PyTorch's differentiable gather after the search. The distances differentiate with
respect to both clouds; the indices are cuML's, and so is their order among points at
equal distance (every other backend takes the lowest reference index first).
``as_op=False`` calls cuML directly instead of through ``torch.ops.cuml.knn``;
``algorithm`` picks cuML's search (``rbc`` unless told otherwise).
"""

from __future__ import annotations

import importlib.util

import torch

from ..registry import Backend, register
from .ops import (
    ALGORITHMS,
    DEFAULT_ALGORITHM,
    auto_choice,
    knn_fake,
    knn_op,
    knn_plain,
    search,
)

__all__ = [
    "ALGORITHMS",
    "BACKEND",
    "auto_choice",
    "available",
    "knn",
    "knn_fake",
    "knn_op",
    "knn_plain",
    "search",
]


def available() -> bool:
    """cuML is installed and a CUDA device is present (cuML is not imported here)."""
    return torch.cuda.is_available() and importlib.util.find_spec("cuml") is not None


def knn(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    k: int,
    *,
    as_op: bool = True,
    algorithm: str = DEFAULT_ALGORITHM,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuML kNN through the custom operator (``as_op=True``) or called directly, with
    one of cuML's exact searches (``algorithm``, see :data:`ALGORITHMS`)."""
    if as_op:
        return torch.ops.cuml.knn(p_query, p_ref, k, algorithm)
    return knn_plain(p_query, p_ref, k, algorithm)


BACKEND = register(
    Backend(
        "cuml",
        devices=("cuda",),
        available=available,
        knn=knn,
        operators={"knn": "cuml::knn"},
        chapter=3,
        position_grads=("knn",),
        toolchain="the RAPIDS wheels (cuML, RMM, CuPy)",
    )
)
