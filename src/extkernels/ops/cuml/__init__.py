"""The ``cuml`` backend: RAPIDS cuML's nearest-neighbour search (chapter 3), CUDA only.

The backend registers only its search; ``knn_aggregate`` is the registry's derived one, with
PyTorch's differentiable gather after the search (neither distances nor indices need a
gradient). ``as_op=False`` calls cuML directly instead of through ``torch.ops.cuml.knn``.
"""

from __future__ import annotations

import importlib.util

import torch

from ..registry import Backend, register
from .ops import knn_op, knn_plain

__all__ = ["BACKEND", "available", "knn", "knn_op", "knn_plain"]


def available() -> bool:
    """cuML is installed and a CUDA device is present (cuML is not imported here)."""
    return torch.cuda.is_available() and importlib.util.find_spec("cuml") is not None


def knn(
    p_query: torch.Tensor, p_ref: torch.Tensor, k: int, *, as_op: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuML kNN through the custom operator (``as_op=True``) or called directly."""
    if as_op:
        return torch.ops.cuml.knn(p_query, p_ref, k)
    return knn_plain(p_query, p_ref, k)


BACKEND = register(
    Backend(
        "cuml",
        devices=("cuda",),
        available=available,
        knn=knn,
        operators={"knn": "cuml::knn"},
        chapter=3,
    )
)
