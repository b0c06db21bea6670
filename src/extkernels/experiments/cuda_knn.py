"""The experiments of chapter 9 around the C++ operators: the float4 gather timed
against the scalar one, the launches and kernels of a profiled training step, and the
numbers the chapter's prose quotes from its tables.

The measuring functions need a CUDA GPU; the ``*_quotes`` functions only read tables,
and return ``{glue key: value}`` for the chapter's hidden glue cells.
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import torch

from ..ops.checks import value_checks
from ..profiling import profile, runtime_calls

__all__ = [
    "vector_loads",
    "launches",
    "vector_load_quotes",
    "timing_quotes",
]

#: The variants whose training medians the prose quotes, by the prefix of their glue
#: keys.
QUOTED = {
    "graphs": "knn/cpp+graphs",
    "ro": "knn/cpp+reduce-overhead",
}

#: The runtime calls that launch work on the GPU: a CUDA graph, or one kernel.
GRAPH_LAUNCHES = ("cudaGraphLaunch",)
KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel")


def vector_loads(p_query, p_ref, feats, k: int, sigma: float) -> pd.DataFrame:
    """The gather of chapter 9 with scalar and float4 loads at 32 float32 features, and
    the whole aggregation (search and gather) with ``feats`` ``(N, F)`` in float32 and
    float16 (converted in the timed call), each timed by ``triton.testing.do_bench``
    (CUDA only). Value checks are off, so that no call synchronises.

    Returns:
        DataFrame indexed by what was timed, one column ``ms (do_bench)``.
    """
    from triton.testing import do_bench  # Triton is optional; do_bench needs CUDA

    ops = torch.ops.extkernels_cpp
    f32 = torch.randn(p_ref.shape[0], 32, device=p_ref.device)
    with value_checks(False):
        _, w, i = ops.knn_aggregate_fwd(p_query, p_ref, f32, k, sigma)
        loads = {
            "gather, 32 features, scalar loads": do_bench(
                lambda: ops.gather(w, i, f32, False)
            ),
            "gather, 32 features, float4 loads": do_bench(
                lambda: ops.gather(w, i, f32, True)
            ),
            "search + gather, 25 features, float32": do_bench(
                lambda: ops.knn_aggregate_fwd(p_query, p_ref, feats, k, sigma)
            ),
            "search + gather, 25 features, float16": do_bench(
                lambda: ops.knn_aggregate_fwd(p_query, p_ref, feats.half(), k, sigma)
            ),
        }
    return pd.Series(loads, name="ms (do_bench)").to_frame()


def launches(step: Callable[[], object], device: torch.device) -> pd.DataFrame:
    """The CUDA graph launches and kernel launches of ``step`` per call, from
    ``torch.profiler`` over ten calls after five of warm-up, value checks off (chapter
    9's training step through ``mode="reduce-overhead"``).

    Returns:
        :func:`~extkernels.profiling.runtime_calls`'s table: ``name``, ``calls``, ``host
        time (ms)``.
    """
    with value_checks(False):
        prof = profile(step, device=device, n_iters=10, warmup=5)
    return runtime_calls(prof, names=GRAPH_LAUNCHES + KERNEL_LAUNCHES)


def vector_load_quotes(loads: pd.DataFrame) -> dict[str, float]:
    """``float4_gain``: how many times as fast as the scalar gather the float4 one ran,
    from :func:`vector_loads`'s table."""
    ms = loads["ms (do_bench)"]
    gain = (
        ms["gather, 32 features, scalar loads"]
        / ms["gather, 32 features, float4 loads"]
    )
    return {"float4_gain": float(gain)}


def timing_quotes(table: pd.DataFrame) -> dict[str, float]:
    """The medians the prose quotes from chapter 9's benchmark table (from
    :func:`~extkernels.benchmark.run_all`): ``<prefix>_train_ms`` for each variant of
    :data:`QUOTED`."""
    return {
        f"{prefix}_train_ms": float(table.loc[name, "train_ms"])
        for prefix, name in QUOTED.items()
    }
