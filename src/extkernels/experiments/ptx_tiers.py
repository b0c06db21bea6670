"""PTX from Python, measured: the small experiments of chapter 10.

:func:`call_costs` times one gather per call through each way of calling it (pyptx's
kernel object, pyptx's own operator, the book's operator eager, compiled, and replayed
in a CUDA graph); :func:`kernel_times` times the same gather and scatter written in
C++, Triton and PTX on the device; :func:`build_costs` measures pyptx's build per shape
and :func:`bucket_builds` what padding to buckets saves; :func:`compile_directly` asks
``torch.compile`` to trace pyptx's kernel object itself. All these but
:func:`bucket_builds` need a Hopper GPU. :func:`call_costs_glue` gives the number the
chapter's prose quotes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import pandas as pd
import torch
from pyptx.jax_support import get_cubin_registry

from ..graphs import CapturedStep
from ..ops.checks import value_checks
from ..ops.ptx import kernels
from ..ops.triton import ops as triton_ops
from ..timing import device_quantiles, first_call_seconds, time_blocks

__all__ = [
    "builds",
    "pyptx_operator",
    "call_costs",
    "kernel_times",
    "build_costs",
    "bucket",
    "bucket_builds",
    "compile_directly",
    "call_costs_glue",
]

#: The rows of :func:`call_costs` the prose quotes, by glue key (``<key>_us``).
CALL_ROWS = {
    "gather_device": "the kernel alone (do_bench: device time, L2 emptied first)",
}


def builds(kernel) -> list[int]:
    """pyptx's handles of ``kernel``'s builds in this process, oldest first: the
    records of pyptx's cubin registry (handles 1, 2, ... in the order built) that carry
    the kernel's name."""
    registry = get_cubin_registry()
    records = (registry.get(h) for h in range(1, len(registry) + 1))
    return [r.handle for r in records if r and r.kernel_name == kernel.__name__]


def gather_shapes(weights, feats) -> dict[str, int]:
    """The sizes the PTX gather is built for: ``M`` queries, ``K`` neighbours, ``N``
    points, ``F`` features."""
    return dict(
        M=weights.shape[0], K=weights.shape[1], N=feats.shape[0], F=feats.shape[1]
    )


def pyptx_operator(kernel, **shapes: int) -> Callable:
    """The custom operator pyptx registered for ``kernel`` built for ``shapes``
    (``pyptx::kernel_<handle>``: a list of tensors in, a list out): the build whose
    PTX is the kernel's for those sizes."""
    ptx = kernel.ptx(**shapes)
    registry = get_cubin_registry()
    handle = next(h for h in builds(kernel) if registry.get(h).ptx_source == ptx)
    return getattr(torch.ops.pyptx, f"kernel_{handle}")


def call_costs(
    weights, indices, feats, *, n_iters: int = 2000, repeats: int = 7
) -> pd.DataFrame:
    """Microseconds per call of the PTX gather, called each way, back to back: the
    median of ``repeats`` blocks of ``n_iters`` calls, with the fastest and slowest
    block as ``low`` and ``high`` (value checks off, as in timed iterations); last, the
    kernel's own time on the device (:func:`~extkernels.timing.device_quantiles`: the
    L2 cache emptied before each call, no host work between its events; median, with
    the 20th and 80th percentiles as ``low`` and ``high``)."""
    args = (weights, indices, feats)
    ours = torch.ops.extkernels_ptx.gather
    kernels.gather(*args)  # builds this shape (and pyptx's operator for it)
    theirs = pyptx_operator(kernels.gather, **gather_shapes(weights, feats))
    compiled = torch.compile(lambda w, i, f: ours(w, i, f), fullgraph=True)
    ways: dict[str, Callable[[], object]] = {
        "pyptx kernel object (its C++ bridge)": lambda: kernels.gather(*args),
        "pyptx's operator (pyptx::kernel_<handle>)": lambda: theirs(list(args)),
        "extkernels_ptx::gather (checks + kernel)": lambda: ours(*args),
        "extkernels_ptx::gather, torch.compile(fullgraph=True)": lambda: compiled(
            *args
        ),
    }
    rows = {}
    with value_checks(False):
        ways["extkernels_ptx::gather, CUDA graph replay"] = CapturedStep(
            lambda: ours(*args)
        )
        ways["for scale: torch.add"] = lambda: torch.add(feats, 1.0)
        for name, fn in ways.items():
            for _ in range(3):
                fn()
            median, fastest, slowest = time_blocks(fn, n_iters, repeats)
            rows[name] = {
                "µs per call": median * 1e3,
                "low": fastest * 1e3,
                "high": slowest * 1e3,
            }
    p20, p50, p80 = device_quantiles(lambda: kernels.gather(*args))
    rows["the kernel alone (do_bench: device time, L2 emptied first)"] = {
        "µs per call": p50 * 1e3,
        "low": p20 * 1e3,
        "high": p80 * 1e3,
    }
    return pd.DataFrame(rows).T


def kernel_times(weights, indices, feats, grad_out) -> pd.DataFrame:
    """Device milliseconds (``do_bench``: median, 20th and 80th percentiles) of the
    gather and of its adjoint, the scatter, in PyTorch, C++ (chapter 9), Triton and PTX,
    on the same inputs. Each kernel is called with as little Python around it as its
    language allows (the C++ operators, Triton's launcher, pyptx's kernel object), and
    every scatter allocates its zeros; :func:`~extkernels.timing.device_quantiles`
    times each, replayed from a CUDA graph, so that no launch shows as device time."""
    cpp = torch.ops.extkernels_cpp
    n_ref = feats.shape[0]
    contributions = weights.unsqueeze(-1) * grad_out.unsqueeze(1)
    ways = {
        ("gather", "PyTorch (index, multiply, sum)"): lambda: (
            weights.unsqueeze(-1) * feats[indices]
        ).sum(dim=1),
        ("gather", "C++, scalar loads"): lambda: cpp.gather(
            weights, indices, feats, False
        ),
        ("gather", "Triton"): lambda: triton_ops.gather(weights, indices, feats),
        ("gather", "PTX (pyptx)"): lambda: kernels.gather(weights, indices, feats),
        ("scatter", "PyTorch (index_add_)"): lambda: feats.new_zeros(
            feats.shape
        ).index_add_(0, indices.reshape(-1), contributions.flatten(0, 1)),
        ("scatter", "C++"): lambda: cpp.knn_aggregate_bwd(
            grad_out, weights, indices, n_ref
        ),
        ("scatter", "Triton"): lambda: torch.ops.triton_knn.knn_aggregate_bwd(
            grad_out, weights, indices, n_ref
        ),
        ("scatter", "PTX (pyptx)"): lambda: kernels.scatter(
            weights, indices, grad_out, feats.new_zeros(feats.shape)
        ),
    }
    if feats.shape[1] % 4 == 0:
        ways[("gather", "C++, float4 loads")] = lambda: cpp.gather(
            weights, indices, feats, True
        )
    rows = {}
    with value_checks(False):
        for key, fn in ways.items():
            p20, p50, p80 = device_quantiles(fn)
            rows[key] = {"ms": p50, "p20": p20, "p80": p80}
    table = pd.DataFrame(rows).T.sort_index(level=0, sort_remaining=False)
    table.index.names = ["piece", "written in"]
    return table


def build_costs(feats, k: int, sizes: list[int], *, seed: int = 0) -> pd.DataFrame:
    """For each number of queries ``M`` in ``sizes`` (new to the kernel): milliseconds
    of the first call (trace, ``ptxas``, load, launch), of tracing alone, and of the
    second call; and how many builds the kernel then holds."""
    g = torch.Generator(device=feats.device).manual_seed(seed)
    rows = []
    for m in sizes:
        weights = torch.rand((m, k), generator=g, device=feats.device)
        indices = torch.randint(
            0, feats.shape[0], (m, k), generator=g, device=feats.device
        )
        shapes = dict(M=m, K=k, N=feats.shape[0], F=feats.shape[1])
        start = time.perf_counter()
        kernels.gather.ptx(**shapes)
        trace_s = time.perf_counter() - start
        call = functools.partial(kernels.gather, weights, indices, feats)
        first = first_call_seconds(call, feats.device)
        second = first_call_seconds(call, feats.device)
        rows.append(
            {
                "M": m,
                "first call (ms)": first * 1e3,
                "of which tracing (ms)": trace_s * 1e3,
                "second call (ms)": second * 1e3,
                "builds held": len(builds(kernels.gather)),
            }
        )
    return pd.DataFrame(rows).set_index("M")


def bucket(m: int, *, smallest: int = 1024) -> int:
    """The padded size for ``m`` rows: the next power of two, at least ``smallest``."""
    size = smallest
    while size < m:
        size *= 2
    return size


def bucket_builds(sizes: list[int]) -> pd.DataFrame:
    """How many builds a stream of clouds of the given sizes costs, shape by shape and
    padded to :func:`bucket` sizes (counted, not run: no GPU needed)."""
    exact, padded = set(), set()
    rows = []
    for m in sizes:
        exact.add(m)
        padded.add(bucket(m))
        rows.append(
            {
                "M": m,
                "padded to": bucket(m),
                "builds, one per shape": len(exact),
                "builds, one per bucket": len(padded),
            }
        )
    return pd.DataFrame(rows)


def compile_directly(weights, indices, feats) -> pd.Series:
    """What Dynamo makes of a function that calls pyptx's kernel object itself: the
    graphs ``torch._dynamo.explain`` reports, the graph breaks it gives a reason for
    (its own count is the graphs less one, which misses a break after which no graph
    follows) with the first reason, and whether ``fullgraph=True`` compiles (else the
    error's first line)."""

    def fn(w, i, f):
        return kernels.gather(w, i, f)

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(weights, indices, feats)
    reasons = [str(b.reason).splitlines()[0] for b in explanation.break_reasons]
    torch._dynamo.reset()
    try:
        torch.compile(fn, fullgraph=True)(weights, indices, feats)
        fullgraph = "compiles"
    except Exception as e:  # noqa: BLE001  (the outcome is the result)
        fullgraph = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return pd.Series(
        {
            "graphs": explanation.graph_count,
            "graph breaks": len(reasons),
            "first reason": reasons[0] if reasons else "(none)",
            "fullgraph=True": fullgraph,
        },
        name="torch.compile of pyptx's kernel object",
    )


def call_costs_glue(costs: pd.DataFrame) -> dict[str, float]:
    """Microseconds per call from :func:`call_costs` that chapter 10's prose quotes, by
    glue key."""
    return {
        f"{key}_us": float(costs.loc[row, "µs per call"])
        for key, row in CALL_ROWS.items()
    }
