"""The ``torch`` backend: the brute force in plain PyTorch (chapters 1-2), the reference
every other backend is checked against. Its projector has no custom operator:
``torch.compile`` traces it. Its radius search, whose output size depends on the data,
is one (:mod:`~.radius_search`, ``extkernels_torch::radius_search``).

Its ``knn_aggregate`` is the registry's derived one (the search, then
:func:`~extkernels.ops.gather.softmax_gather`), like every kNN backend's. It takes a
batch of clouds natively in every operation (``batched``): one masked brute force.

The lambda of its book record builds its variants of the benchmark from
:mod:`extkernels.variants`, which it is given (a backend imports nothing above it).
"""

from ..registry import Backend, Book, register
from .brute_force import knn, radius_aggregate
from .radius_search import radius_search

__all__ = ["BACKEND", "knn", "radius_aggregate", "radius_search"]

BACKEND = register(
    Backend(
        "torch",
        knn=knn,
        radius_aggregate=radius_aggregate,
        radius_search=radius_search,
        operators={"radius_search": "extkernels_torch::radius_search"},
        position_grads=("knn", "radius_aggregate", "radius_search"),
        batched=("knn", "radius_aggregate"),
        book=Book(
            chapter=1,
            toolchain="PyTorch only",
            variants=lambda v: [
                v.Variant("knn/torch", "knn", "torch", chapter=1),
                v.compiled("knn/torch+compile", "torch", 2),
                v.Variant("radius/torch", "radius", "torch", chapter=5),
                v.compiled("radius/torch+compile", "torch", 5),
            ],
            glossary={"torch": "the PyTorch brute force (chapters 1 and 5)"},
            advice=lambda g: [
                g.Advice(
                    "A reference to test against, a prototype",
                    "the PyTorch brute force, compiled (chapters 1 and 2)",
                    "knn/torch+compile",
                    geometry=lambda e: (
                        "the same work on any cloud; memory grows as N × M (chapter 12)"
                    ),
                    reference=True,
                )
            ],
            shipped="knn",
        ),
    )
)
