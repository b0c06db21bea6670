"""What to use when: the book's advice as a table built from its measurements, on the
book's cloud (the benchmark command) and on real geometry (chapter 14's geometry
command and its benchmark variants on CAD meshes), with what adopting each choice
costs. The results page opens with it; chapter 12 derives it.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from . import results

__all__ = ["GLOSSARY", "TOOLCHAIN", "guide", "source_lines"]

_OPS = Path(__file__).parent / "ops"

#: What each backend needs on the reader's machine beyond PyTorch.
TOOLCHAIN = {
    "torch": "PyTorch only",
    "triton": "PyTorch only (Triton ships with it)",
    "cpp": "nvcc and a C++ compiler; compiled once per machine",
    "fused": "nvcc and a C++ compiler; compiled once per machine",
    "ptx": "pyptx",
    "warp": "the warp-lang wheel",
    "cuml": "the RAPIDS wheels (cuML, RMM, CuPy)",
}

#: The parts of a variant's name (``workload/backend+option@cloud``).
GLOSSARY = {
    "knn/, radius/": "the workload: the kNN projector or the radius projector",
    "torch": "the PyTorch brute force (chapters 1 and 5)",
    "cuml": "cuML's NearestNeighbors called from Python (chapter 3)",
    "cuml-op": "cuML's search registered as a custom operator (chapter 3)",
    "warp": "NVIDIA Warp's hash grid as a custom operator (chapters 5 to 7)",
    "warp-saved, warp-manual": "Warp's backward from saved neighbours, or written by "
    "hand instead of Warp's tape (chapter 6)",
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
    "+1thread": "Warp's backward on the calling thread (chapter 7)",
    "@panda, @spitfire, @outlier": "the reference cloud sampled on a CAD mesh or "
    "with a far outlier (chapter 14); without it, the book's cloud",
}


def source_lines(backend: str) -> int:
    """Non-blank lines of a backend's sources in this package (Python, CUDA, C++)."""
    files = [
        f
        for f in sorted((_OPS / backend).rglob("*"))
        if f.suffix in {".py", ".cu", ".cuh", ".cpp", ".h"}
    ]
    return sum(1 for f in files for line in f.read_text().splitlines() if line.strip())


def _cost(bench: pd.DataFrame, variant: str, backend: str) -> str:
    first = bench.loc[variant, "first_call_s"] if variant in bench.index else None
    when = (
        ""
        if first is None or first != first
        else f"; first call of a new process {first:.1f} s"
    )
    return f"{source_lines(backend):,} lines; {TOOLCHAIN[backend]}{when}"


def _train(bench: pd.DataFrame, variant: str) -> str:
    if variant not in bench.index:
        return "not measured"
    return f"{bench.loc[variant, 'train_ms']:.3f} ms per training step"


def _worst(times: pd.DataFrame, method: str, n: int = 1_000_000) -> str:
    ms = results.at_size(times, n, [method])[method]
    return f"up to {ms.max():,.0f} ms per search at 10⁶ points ({ms.idxmax()})"


def guide(
    bench: pd.DataFrame, clouds: pd.DataFrame, times: pd.DataFrame
) -> pd.DataFrame:
    """The advice, one row per situation: what to use, its training step on the
    book's cloud (``bench``, the benchmark command's table), how it fares on real
    geometry (``times``, the geometry command's table; ``clouds``, the benchmark's
    variants on other clouds) and what it costs to adopt."""
    tree = results.targets(times)
    train = clouds["train_ms"]
    mesh_ratio = max(
        train[f"knn/fused+graphs@{m}"] / train["knn/fused+graphs"]
        for m in ("panda", "spitfire")
    )
    radius = results.radius_targets(times)
    fused_x, warp_x = radius["fused-radius / normal"], radius["warp-radius / normal"]
    cuml = results.at_size(times, 1_000_000, ["cuml"])["cuml"]
    rows = [
        (
            "A reference to test against, a prototype",
            "the PyTorch brute force, compiled (chapters 1 and 2)",
            _train(bench, "knn/torch+compile"),
            "the same work on any cloud; memory grows as N × M (chapter 12)",
            _cost(bench, "knn/torch+compile", "torch"),
        ),
        (
            "kNN in a training loop, any cloud",
            "the fused operators (chapters 11 and 14), the step in one CUDA graph",
            _train(bench, "knn/fused+graphs"),
            f"search at most {tree['ms at 10⁶'].max():.2f} ms at 10⁶ points on "
            f"every cloud, {tree['x cuml at 10⁶'].min():.0f}× cuML or more; "
            f"training step on CAD meshes within {mesh_ratio:.2f}× the book's cloud",
            _cost(bench, "knn/fused+graphs", "fused"),
        ),
        (
            "kNN on clouds known to be blobs",
            "the fused operators with index='grid' (chapter 11)",
            _train(clouds, "knn/fused-grid+graphs"),
            f"falls off a cliff: {_worst(times, 'fused-grid')}",
            _cost(clouds, "knn/fused-grid+graphs", "fused"),
        ),
        (
            "kNN without a C++ toolchain",
            "the Triton grid search (chapter 8)",
            _train(bench, "knn/triton+reduce-overhead"),
            f"the same cliff, {_worst(times, 'triton')}; there cuML's brute force "
            f"({cuml.min():.0f} to {cuml.max():.0f} ms on every cloud) is safer",
            _cost(bench, "knn/triton+reduce-overhead", "triton"),
        ),
        (
            "A kNN library you already use (cuML)",
            "a custom operator with a fake and an autograd formula (chapter 3), one "
            "memory pool (chapter 4)",
            _train(bench, "knn/cuml-op+compile+rmm"),
            f"a brute force: {cuml.min():.0f} to {cuml.max():.0f} ms per search at "
            "10⁶ points on every cloud; no CUDA graph can hold it",
            _cost(bench, "knn/cuml-op+compile+rmm", "cuml"),
        ),
        (
            "Radius neighbourhoods",
            "the fused warp-per-query walk (chapter 11) in one graph",
            _train(bench, "radius/fused+graphs"),
            f"at most {fused_x.max():.1f}× its time on the book's cloud, on every "
            f"cloud ({fused_x.idxmax()})",
            _cost(bench, "radius/fused+graphs", "fused"),
        ),
        (
            "Radius neighbourhoods, Warp already in your stack",
            "Warp's hash grid as a custom operator (chapters 5 to 7)",
            _train(bench, "radius/warp+graphs"),
            f"up to {warp_x.max():.1f}× its time on the book's cloud "
            f"({warp_x.idxmax()})",
            _cost(bench, "radius/warp+graphs", "warp"),
        ),
    ]
    columns = ["situation", "use", "on the book's cloud", "on real geometry", "cost"]
    return pd.DataFrame(rows, columns=columns).set_index("situation")
