"""The ``triton`` backend (chapter 8): an exact kNN search, and the search fused with
the softmax-gather aggregation, written in Triton and registered with
``torch.library.triton_op`` so that ``torch.compile`` traces into the kernel launches.

On CUDA tensors the kernels run (the grid walk, see :mod:`~.spatial`); on CPU
tensors the operators run the brute force (``register_kernel("cpu")``), so the backend
works everywhere; the tests run the kernels themselves on the CPU through Triton's
interpreter (``TRITON_INTERPRET=1``).
"""

import importlib.util

import torch

from ..registry import Backend, Book, register

__all__ = ["BACKEND", "available"]


def available() -> bool:
    """Triton is installed (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def _knn(p_query, p_ref, k):

    from .ops import knn_op  # noqa: F401  (registers the operators)

    return torch.ops.triton_knn.knn(p_query, p_ref, k)


def _knn_aggregate(p_query, p_ref, feats, k, sigma):
    from .ops import knn_aggregate

    return knn_aggregate(p_query, p_ref, feats, k, sigma)


BACKEND = register(
    Backend(
        "triton",
        available=available,
        knn=_knn,
        knn_aggregate=_knn_aggregate,
        operators={
            "knn": "triton_knn::knn",
            "knn_aggregate": "triton_knn::knn_aggregate_fwd",
        },
        position_grads=("knn", "knn_aggregate"),
        python_module=__name__,
        book=Book(
            chapter=8,
            toolchain="PyTorch only (Triton ships with it)",
            variants=lambda v: [
                v.Variant("knn/triton", "knn", "triton", chapter=8),
                v.compiled("knn/triton+compile", "triton", 8),
                v.compiled(
                    "knn/triton+reduce-overhead", "triton", 8, mode="reduce-overhead"
                ),
            ],
            glossary={"triton": "a grid search written in Triton (chapter 8)"},
            advice=lambda g: [
                g.Advice(
                    "kNN without a C++ toolchain",
                    "the Triton grid search (chapter 8), a triton_op {registered}",
                    "knn/triton+reduce-overhead",
                    "knn_aggregate",
                    lambda e: (
                        f"the same cliff, {g.worst(e, 'triton')}; there cuML's "
                        f"search ({g.search_range(e, 'cuml')} on every cloud) is safer"
                    ),
                )
            ],
            methods={"triton": {}},
            shipped="knn",
        ),
    )
)

if available():
    from . import ops  # noqa: F401  (registers the operators)
