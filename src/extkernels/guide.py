"""What to use when: the book's advice as a table built from its measurements, on the
book's cloud (the benchmark command) and on real geometry (chapter 14's geometry
command and its benchmark variants on CAD meshes), with what adopting each choice
costs. The results page opens with it; chapter 12 derives it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from . import results
from .ops import registry
from .ops.cuml import DEFAULT_ALGORITHM as CUML_ALGORITHM

__all__ = [
    "AUTOGRAD",
    "CUML_SEARCHES",
    "GLOSSARY",
    "JIT_VARIANTS",
    "ROWS",
    "guide",
    "source_lines",
    "toolchain",
]

_OPS = Path(__file__).parent / "ops"

#: Each row of the guide: the backend it recommends and the operation whose custom
#: operator the row describes (``None``: plain PyTorch, no operator of its own).
ROWS = {
    "A reference to test against, a prototype": ("torch", None),
    "kNN in a training loop, any cloud": ("fused", "knn_aggregate"),
    "kNN on clouds known to be blobs": ("fused", "knn_aggregate"),
    "kNN without a C++ toolchain": ("triton", "knn_aggregate"),
    "A kNN library you already use (cuML)": ("cuml", "knn"),
    "Radius neighbourhoods": ("fused", "radius_aggregate"),
    "Radius neighbourhoods, Warp already in your stack": ("warp", "radius_aggregate"),
}

#: Whether the custom operator of a (backend, operation) has an autograd formula, as
#: its chapter registers it: the guide's words follow it, and the tests check it
#: against the dispatcher (``tests/test_guide_words.py``).
#: cuML's operator is only the search: its distances differentiate with respect to both
#: clouds (ops.positions), and PyTorch's gather after it carries the features'.
AUTOGRAD = {
    ("cuml", "knn"): True,
    ("triton", "knn_aggregate"): True,
    ("fused", "knn_aggregate"): True,
    ("fused", "radius_aggregate"): True,
    ("warp", "radius_aggregate"): True,
}

#: cuML's exact searches as the guide names them; it names the one the book's operator
#: runs (``extkernels.ops.cuml.DEFAULT_ALGORITHM``, chapter 3).
CUML_SEARCHES = {"rbc": "random ball cover (RBC)", "brute": "brute force"}

#: The parts of a variant's name (``workload/backend+option@cloud``).
GLOSSARY = {
    "knn/, radius/": "the workload: the kNN projector or the radius projector",
    "torch": "the PyTorch brute force (chapters 1 and 5)",
    "cuml": "cuML's NearestNeighbors called from Python (chapter 3)",
    "cuml-op": "cuML's search registered as a custom operator (chapter 3)",
    "warp": "NVIDIA Warp's hash grid as a custom operator (chapters 5 to 7)",
    "warp-saved, warp-manual": "Warp's operator handing the normalisers to its "
    "backward through ctx and building the grid again, or with a backward kernel "
    "written by hand instead of Warp's adjoint (chapter 6)",
    "triton": "a grid search written in Triton (chapter 8)",
    "cpp": "a grid search in CUDA C++, one thread per query (chapter 9)",
    "ptx": "chapter 9's search with a gather written in PTX through pyptx (chapter 10)",
    "fused": "the fused CUDA operators of chapter 11: search, softmax and gather in "
    "one kernel; for kNN on the tree of chapter 14",
    "fused-grid": "the fused kNN on chapter 11's grid instead of the tree (chapter 14)",
    "floor": "no aggregation at all: the model around it, the least any variant can "
    "take (chapters 9 and 11)",
    "+compile": "the model compiled with torch.compile",
    "+reduce-overhead": "compiled with mode='reduce-overhead' (CUDA graphs by the "
    "compiler)",
    "+graphs": "the forward pass and training step captured in one CUDA graph by hand "
    "(chapter 7)",
    "+rmm, +rmm-rapids": "PyTorch and RAPIDS sharing one RMM pool, or only RAPIDS "
    "in it (chapter 4)",
    "+1thread": "autograd runs the whole backward on the calling thread instead of its "
    "device thread (chapter 7)",
    "@panda, @spitfire, @outlier": "the reference cloud sampled on a CAD mesh or "
    "with a far outlier (chapter 14); without it, the book's cloud",
}


def toolchain(backend: str) -> str:
    """What a backend needs on the reader's machine beyond PyTorch, as its registration
    says (``Backend.toolchain``)."""
    words = registry.get(backend).toolchain
    if not words:
        raise ValueError(
            f"backend: {backend!r} registers no toolchain (Backend(toolchain=...))"
        )
    return words


def source_lines(backend: str) -> int:
    """Non-blank lines of a backend's sources in this package (Python, CUDA, C++)."""
    files = [
        f
        for f in sorted((_OPS / backend).rglob("*"))
        if f.suffix in {".py", ".cu", ".cuh", ".cpp", ".h"}
    ]
    return sum(1 for f in files for line in f.read_text().splitlines() if line.strip())


def _registered(backend: str, operation: str) -> str:
    """What a backend's operator registers beside its kernel, in words."""
    if AUTOGRAD[(backend, operation)]:
        return "with a fake and an autograd formula"
    # a search alone: the neighbours carry no gradient, PyTorch's gather after it does
    return "with a fake and no gradient formula, which the neighbours do not need"


#: The variant whose first call builds a backend's libraries just in time into an empty
#: extension cache (chapter 15's shipping file), for the backends the guide names.
JIT_VARIANTS = {"fused": "knn/fused+graphs+jit"}


def _first_calls(table: pd.DataFrame | None, variant: str | None) -> tuple:
    """A variant's first call in a fresh process: its first run's (empty caches) and
    its later runs' (the caches the first left), NaN where not measured."""
    if table is None or variant not in table.index:
        return math.nan, math.nan
    row = table.loc[variant]
    return tuple(row.get(c, math.nan) for c in ("first_call_s", "warm_first_call_s"))


def _cost(
    bench: pd.DataFrame,
    variant: str,
    backend: str,
    shipping: pd.DataFrame | None = None,
) -> str:
    first, warm = _first_calls(bench, variant)
    when = "" if first != first else f"; first call of a new process {first:.1f} s"
    if when and warm == warm:  # the benchmark's later runs: the caches the first left
        when += f" ({warm:.1f} s with the compilers' caches warm)"
    jit, jit_warm = _first_calls(shipping, JIT_VARIANTS.get(backend))
    if jit == jit:
        when += (
            f"; without the prebuilt wheel, {jit:.1f} s to build just in time into an "
            "empty extension cache"
        )
        if jit_warm == jit_warm:
            when += f" ({jit_warm:.1f} s from a warm one)"
    return f"{source_lines(backend):,} lines; {toolchain(backend)}{when}"


def _train(bench: pd.DataFrame, variant: str) -> str:
    if variant not in bench.index:
        return "not measured"
    return f"{bench.loc[variant, 'train_ms']:.3f} ms per training step"


def _worst(times: pd.DataFrame, method: str, n: int = 1_000_000) -> str:
    ms = results.at_size(times, n, [method])[method]
    most = f"{float(results.at_most(ms.max())):,.0f}"  # a worst case rounds up
    return f"up to {most} ms per search at 10⁶ points ({ms.idxmax()})"


def guide(
    bench: pd.DataFrame,
    clouds: pd.DataFrame,
    times: pd.DataFrame,
    shipping: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """The advice, one row per situation: what to use, its training step on the
    book's cloud (``bench``, the benchmark command's table), how it fares on real
    geometry (``times``, the geometry command's table; ``clouds``, the benchmark's
    variants on other clouds) and what it costs to adopt, first calls included: each
    variant's own, and where ``shipping`` (chapter 15's file) is given, the libraries
    built just in time instead of loaded from the prebuilt wheel."""
    tree = results.tree_times(times)
    train = clouds["train_ms"]
    mesh_ratio = max(
        train[f"knn/fused+graphs@{m}"] / train["knn/fused+graphs"]
        for m in ("panda", "spitfire")
    )
    radius = results.radius_times(times)
    fused_x, warp_x = radius["fused-radius / normal"], radius["warp-radius / normal"]
    cuml = results.at_size(times, 1_000_000, ["cuml"])["cuml"]
    search = CUML_SEARCHES[CUML_ALGORITHM]
    cuml_ms = f"{results.at_least(cuml.min())} to {results.at_most(cuml.max())} ms"
    most_ms = results.at_most(tree["ms at 10⁶"].max(), 2)
    least_x = results.at_least(tree["x cuml at 10⁶"].min())
    rows = [
        (
            "the PyTorch brute force, compiled (chapters 1 and 2)",
            _train(bench, "knn/torch+compile"),
            "the same work on any cloud; memory grows as N × M (chapter 12)",
            _cost(bench, "knn/torch+compile", "torch"),
        ),
        (
            "the fused operators (chapters 11 and 14), "
            f"{_registered('fused', 'knn_aggregate')}; the step in one CUDA graph",
            _train(bench, "knn/fused+graphs"),
            f"search at most {most_ms} ms at 10⁶ points on every cloud, "
            f"{least_x}× cuML or more; "
            f"training step on CAD meshes within {results.at_most(mesh_ratio, 2)}× the "
            "book's cloud",
            _cost(bench, "knn/fused+graphs", "fused", shipping),
        ),
        (
            "the fused operators with index='grid' (chapter 11), "
            f"{_registered('fused', 'knn_aggregate')}",
            _train(clouds, "knn/fused-grid+graphs"),
            f"falls off a cliff: {_worst(times, 'fused-grid')}",
            _cost(clouds, "knn/fused-grid+graphs", "fused", shipping),
        ),
        (
            "the Triton grid search (chapter 8), a triton_op "
            f"{_registered('triton', 'knn_aggregate')}",
            _train(bench, "knn/triton+reduce-overhead"),
            f"the same cliff, {_worst(times, 'triton')}; there cuML's search "
            f"({cuml_ms} on every cloud) is safer",
            _cost(bench, "knn/triton+reduce-overhead", "triton"),
        ),
        (
            f"cuML's exact search, its {search}, as a custom operator "
            f"{_registered('cuml', 'knn')} (chapter 3); one memory pool (chapter 4)",
            _train(bench, "knn/cuml-op+compile+rmm"),
            f"little moved by the cloud: {cuml_ms} per search at 10⁶ "
            "points on every cloud; no CUDA graph can hold it",
            _cost(bench, "knn/cuml-op+compile+rmm", "cuml"),
        ),
        (
            "the fused warp-per-query walk (chapter 11), "
            f"{_registered('fused', 'radius_aggregate')}, in one graph",
            _train(bench, "radius/fused+graphs"),
            results.against_book_cloud(fused_x),
            _cost(bench, "radius/fused+graphs", "fused", shipping),
        ),
        (
            "Warp's hash grid as a custom operator "
            f"{_registered('warp', 'radius_aggregate')} (chapters 5 to 7)",
            _train(bench, "radius/warp+graphs"),
            f"up to {results.at_most(warp_x.drop('normal').max(), 1)}× its time on the "
            "book's cloud "
            f"({warp_x.drop('normal').idxmax()})",
            _cost(bench, "radius/warp+graphs", "warp"),
        ),
    ]
    rows = [(situation, *row) for situation, row in zip(ROWS, rows, strict=True)]
    columns = ["situation", "use", "on the book's cloud", "on real geometry", "cost"]
    return pd.DataFrame(rows, columns=columns).set_index("situation")
