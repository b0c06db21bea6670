"""The operators of the running example: entry points, and one subpackage per backend.

- :mod:`~extkernels.ops.dispatch`: ``knn``, ``knn_aggregate``, ``radius_aggregate``,
  each checking its arguments once and calling the backend named by ``backend=``;
- :mod:`~extkernels.ops.checks`: the validation contract every entry point, custom
  operator and fake implementation shares;
- :mod:`~extkernels.ops.registry`: backends as plug-ins (:func:`backends` lists those
  that run here);
- one subpackage per backend, its kernels apart from its glue:
  :mod:`~extkernels.ops.torch` (brute force, chapters 1-2), :mod:`~extkernels.ops.cuml`
  (chapter 3), :mod:`~extkernels.ops.warp` (chapters 5-7), :mod:`~extkernels.ops.triton`
  (chapter 8), :mod:`~extkernels.ops.cpp` (chapter 9), :mod:`~extkernels.ops.ptx`
  (chapter 10), :mod:`~extkernels.ops.fused` (chapter 11). Importing a backend
  registers it.
"""

from . import cpp, cuml, fused, ptx, torch, triton, warp  # noqa: F401  (importing registers)
from .dispatch import knn, knn_aggregate, radius_aggregate
from .registry import backends

__all__ = ["knn", "knn_aggregate", "radius_aggregate", "backends"]
