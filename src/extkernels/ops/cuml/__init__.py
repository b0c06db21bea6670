"""The ``cuml`` backend: RAPIDS cuML's nearest-neighbour search (chapter 3), CUDA only.

The backend registers only its search; ``knn_aggregate`` is the registry's derived one,
with PyTorch's differentiable gather after the search. The distances differentiate with
respect to both clouds; the indices are cuML's, and so is their order among points at
equal distance (every other backend takes the lowest reference index first).
``as_op=False`` calls cuML directly instead of through ``torch.ops.cuml.knn``;
``algorithm`` picks cuML's search (``rbc`` unless told otherwise).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from ..registry import Backend, Book, register
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
    "SEARCHES",
    "auto_choice",
    "available",
    "knn",
    "knn_fake",
    "knn_op",
    "knn_plain",
    "search",
]


#: cuML's exact searches as the book names them (the guide names the one its operator
#: runs, :data:`DEFAULT_ALGORITHM`).
SEARCHES = {"rbc": "random ball cover (RBC)", "brute": "brute force"}


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


def _variants(v) -> list:
    """Its variants of the benchmark (chapters 3 and 4), built with
    :mod:`extkernels.variants` (``v``)."""
    plain = {"as_op": False}
    return [
        v.Variant("knn/cuml", "knn", "cuml", chapter=3, options=plain),
        v.Variant(
            "knn/cuml+compile", "knn", "cuml", compile=True, chapter=3, options=plain
        ),
        v.Variant("knn/cuml-op", "knn", "cuml", chapter=3),
        v.compiled("knn/cuml-op+compile", "cuml", 3),
        v.compiled(
            "knn/cuml-op+compile+rmm", "cuml", 4, isolated=True, setup=v.use_rmm_pool
        ),
        v.compiled(
            "knn/cuml-op+compile+rmm-rapids",
            "cuml",
            4,
            isolated=True,
            setup=functools.partial(v.use_rmm_pool, pytorch=False),
        ),
    ]


def _advice(g) -> list:
    """Its row of the guide (chapter 12), built with :mod:`extkernels.guide` (``g``)."""
    return [
        g.Advice(
            "A kNN library you already use (cuML)",
            f"cuML's exact search, its {SEARCHES[DEFAULT_ALGORITHM]}, as a custom "
            "operator {registered} (chapter 3); one memory pool (chapter 4)",
            "knn/cuml-op+compile+rmm",
            "knn",
            lambda e: (
                f"little moved by the cloud: {g.search_range(e, 'cuml')} per "
                "search at 10⁶ points on every cloud; no CUDA graph can hold it"
            ),
        )
    ]


BACKEND = register(
    Backend(
        "cuml",
        devices=("cuda",),
        available=available,
        knn=knn,
        operators={"knn": "cuml::knn"},
        position_grads=("knn",),
        python_module=__name__,
        book=Book(
            chapter=3,
            toolchain="the RAPIDS wheels (cuML, RMM, CuPy)",
            variants=lambda v: _variants(v),
            glossary={
                "cuml": "cuML's NearestNeighbors called from Python (chapter 3)",
                "cuml-op": "cuML's search registered as a custom operator (chapter 3)",
            },
            advice=lambda g: _advice(g),
            methods={"cuml": {}},
            shipped="knn",
        ),
    )
)
