"""The ``ptx`` backend (chapter 10): the kNN aggregation with its gather, and the
gather's adjoint, written in PTX from Python with pyptx (:mod:`~.kernels`) and
registered as custom operators (:mod:`~.ops`); the search is chapter 9's (the ``cpp``
backend).

The kernels target ``sm_90a`` and launch on a GPU of compute capability 9.0 (Hopper);
on the CPU the operators compute the same sums with PyTorch. The backend is available
where pyptx is installed and the ``cpp`` backend is.
"""

import importlib.util

import torch

from .. import cpp
from ..registry import Backend, Book, lookup, register

__all__ = ["BACKEND", "available"]


def available() -> bool:
    """pyptx is installed (it is not imported here), and so is the search's compiler."""
    return importlib.util.find_spec("pyptx") is not None and cpp.available()


def _knn_aggregate(p_query, p_ref, feats, k, sigma):
    # chapter 9's search, whose distances differentiate with respect to both clouds
    distances, indices = lookup("knn", "cpp", p_query.device)(p_query, p_ref, k)
    weights = torch.softmax(-distances / sigma, dim=1)
    return torch.ops.extkernels_ptx.gather(weights, indices, feats)


BACKEND = register(
    Backend(
        "ptx",
        available=available,
        knn_aggregate=_knn_aggregate,
        position_grads=("knn_aggregate",),
        libraries=cpp.BACKEND.libraries,  # the search's
        python_module=__name__,
        book=Book(
            chapter=10,
            toolchain="pyptx",
            variants=lambda v: [
                v.Variant("knn/ptx", "knn", "ptx", chapter=10),
                v.compiled("knn/ptx+compile", "ptx", 10),
                v.Variant("knn/ptx+graphs", "knn", "ptx", chapter=10, graphs=True),
            ],
            glossary={
                "ptx": "chapter 9's search with a gather written in PTX through pyptx "
                "(chapter 10)"
            },
            shipped="knn",
        ),
    )
)

if available():
    from . import ops  # noqa: F401  (registers the operators)
