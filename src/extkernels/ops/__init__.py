"""The operators of the running example: entry points, and one subpackage per backend.

- :mod:`~extkernels.ops.dispatch`: ``knn``, ``knn_aggregate``, ``radius_aggregate``
  and the neighbour lists ``radius_search`` and ``knn_graph``, each checking its
  arguments once and calling the backend named by ``backend=``;
- :mod:`~extkernels.ops.checks`: the validation contract every entry point, custom
  operator and fake implementation shares;
- :mod:`~extkernels.ops.registry`: backends as plug-ins (:func:`backends` lists those
  that run here);
- one subpackage per backend, its kernels apart from its glue:
  :mod:`~extkernels.ops.torch` (brute force, chapters 1-2), :mod:`~extkernels.ops.cuml`
  (chapter 3), :mod:`~extkernels.ops.warp` (chapters 5-7), :mod:`~extkernels.ops.triton`
  (chapter 8), :mod:`~extkernels.ops.cpp` (chapter 9), :mod:`~extkernels.ops.ptx`
  (chapter 10), :mod:`~extkernels.ops.fused` (chapter 11).

Every subpackage here is a backend, and this package finds them: it imports each one
(in the order of their names), and importing a backend registers it. Adding a backend
is adding its folder; no line here names it.
"""

import importlib
import pkgutil

from .dispatch import knn, knn_aggregate, knn_graph, radius_aggregate, radius_search
from .registry import backends

__all__ = [
    "knn",
    "knn_aggregate",
    "radius_aggregate",
    "radius_search",
    "knn_graph",
    "backends",
]


def _import_backends() -> None:
    """Import every subpackage, a backend's folder (importing registers it)."""
    for found in pkgutil.iter_modules(__path__):
        if found.ispkg:
            importlib.import_module(f"{__name__}.{found.name}")


_import_backends()
