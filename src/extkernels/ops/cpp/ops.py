"""The C++ operators' Python half (chapter 9): the fake implementations and the
autograd formulas of operators whose schemas and kernels live in C++
(``csrc/knn.cpp``, ``csrc/knn_cuda.cu``), registered right after the library loads
(:data:`~.build.on_load`); importing this module builds and loads nothing.

The fakes run the same checks of metadata as the C++ kernels (they raise the same
errors), so a compiled caller fails at trace time. The C++ kernels check values
(finite coordinates) themselves; Python's ``value_checks`` switch reaches them through
the ``set_value_checks`` operator.
"""

import functools

import torch

from .. import checks, positions
from ..checks import check_index_limit, check_knn, check_knn_aggregate
from . import build

__all__ = [
    "FEATS_DTYPES",
    "load",
    "max_k",
    "max_points",
    "check_max_points",
    "knn",
    "knn_aggregate",
    "gather",
    "knn_aggregate_fwd_fake",
    "register_knn_autograd",
]

#: Dtypes of the features the aggregation takes (the C++ kernels dispatch on them; the
#: public entry points take float32).
FEATS_DTYPES = (torch.float32, torch.float64, torch.float16)
_ops = torch.ops.extkernels_cpp
on_load = build.on_load
on_load(lambda: checks.on_value_checks(_ops.set_value_checks))


@torch.compiler.assume_constant_result
def load() -> bool:
    """Build (or find in the cache) and load the library, and register its operators'
    Python half (this module's), once per process: the backend calls it on first use.
    Run eagerly even while ``torch.compile`` traces a caller: the compiler sees only
    its result."""
    build.load()
    return True


@functools.cache
def _limits() -> tuple[int, int]:
    load()
    max_k, max_points = (int(v) for v in _ops.limits())
    return max_k, max_points


@torch.compiler.assume_constant_result
def max_k() -> int:
    """The most neighbours the kernels keep per query (``kMaxK`` in ``grid.h``), read
    from the library (loaded if it is not yet)."""
    return _limits()[0]


@torch.compiler.assume_constant_result
def max_points() -> int:
    """The most reference points the kernels take (``kMaxPoints`` in ``checks.h``),
    read from the library (loaded if it is not yet)."""
    return _limits()[1]


def check_max_points(p_ref) -> None:
    """At most :func:`max_points` reference points, as the C++ kernels ask
    (checks.h): the same message, from the fakes."""
    check_index_limit(
        "p_ref",
        "points",
        p_ref.shape[0],
        max_points(),
        "the kernels index cells and points with 32-bit integers",
    )


def check_max_k(k: int) -> int:
    if k > max_k():
        raise ValueError(
            f"k: expected k <= {max_k()} (the C++ kernels keep at most that many "
            f"neighbours), got {k}"
        )
    return k


@on_load.register_fake("extkernels_cpp::knn")
def knn_fake(p_query, p_ref, k):
    k = check_knn(p_query, p_ref, k, values=False)
    check_max_points(p_ref)
    k = check_max_k(k)
    m = p_query.shape[0]
    return p_query.new_empty((m, k)), p_query.new_empty((m, k), dtype=torch.int64)


@on_load.register_fake("extkernels_cpp::knn_aggregate_fwd")
def knn_aggregate_fwd_fake(p_query, p_ref, feats, k, sigma):
    """What the compiler runs instead of the kernels (chapter 9): their checks of
    metadata, then empty ``out`` ``(M, F)``, ``weights`` ``(M, k)`` and ``indices``
    ``(M, k)`` int64, as the C++ operator returns."""
    k, _ = check_knn_aggregate(
        p_query, p_ref, feats, k, sigma, values=False, feats_dtypes=FEATS_DTYPES
    )
    check_max_points(p_ref)
    check_max_k(k)
    m = p_query.shape[0]
    return (
        feats.new_empty((m, feats.shape[1])),
        p_query.new_empty((m, k)),
        p_query.new_empty((m, k), dtype=torch.int64),
    )


@on_load.register_fake("extkernels_cpp::knn_aggregate_bwd")
def _knn_aggregate_bwd_fake(grad_out, weights, indices, n_ref):
    return grad_out.new_empty((n_ref, grad_out.shape[1]))


@on_load.register_fake("extkernels_cpp::gather")
def _gather_fake(weights, indices, feats, vector_loads=False):
    return feats.new_empty((weights.shape[0], feats.shape[1]))


def register_knn_autograd(op: str) -> None:
    """Give the kNN aggregation operator ``op`` its autograd formula (chapter 9; chapter
    11's fused operator registers the same one). Its forward returns ``(out, weights,
    indices)``; the backward scatters ``grad_out`` ``(M, F)`` through the weights and
    indices into the features' gradient ``(N, F)`` with
    ``extkernels_cpp::knn_aggregate_bwd``, and the clouds' gradients come through the
    weights (:func:`~extkernels.ops.positions.register_knn_aggregate_autograd`, which
    hands the scatter a contiguous ``grad_out``). Both operators must exist: called
    once their libraries are loaded."""
    positions.register_knn_aggregate_autograd(op, _ops.knn_aggregate_bwd)


on_load(lambda: register_knn_autograd("extkernels_cpp::knn_aggregate_fwd"))
on_load(lambda: positions.register_knn_autograd("extkernels_cpp::knn"))


def knn(p_query, p_ref, k):
    """Exact k nearest neighbours by the C++ kernels: distances ``(M, k)`` float32
    ascending, indices ``(M, k)`` int64."""
    load()
    return _ops.knn(p_query, p_ref, k)


def knn_aggregate(p_query, p_ref, feats, k, sigma):
    """The kNN aggregation by the C++ kernels, differentiable in ``feats``: ``(M,
    F)``."""
    load()
    return _ops.knn_aggregate_fwd(p_query, p_ref, feats, k, sigma)[0]


def gather(weights, indices, feats, vector_loads=False):
    """The aggregation's second kernel alone: ``out[q] = sum_j weights[q, j] *
    feats[indices[q, j]]``, reading feature rows as float4 with ``vector_loads``."""
    load()
    return _ops.gather(weights, indices, feats, vector_loads)
