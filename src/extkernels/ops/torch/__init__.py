"""The ``torch`` backend: the brute force in plain PyTorch (chapters 1-2), the reference
every other backend is checked against. It has no custom operator: ``torch.compile``
traces it.

Its ``knn_aggregate`` is the registry's derived one (the search, then
:func:`~extkernels.ops.gather.softmax_gather`), like every kNN backend's.
"""

from ..registry import Backend, register
from .brute_force import knn, radius_aggregate

__all__ = ["BACKEND", "knn", "radius_aggregate"]

BACKEND = register(
    Backend(
        "torch",
        knn=knn,
        radius_aggregate=radius_aggregate,
        chapter=1,
        toolchain="PyTorch only",
        position_grads=("knn", "radius_aggregate"),
    )
)
