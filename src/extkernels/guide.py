"""What to use when: the book's advice as a table built from its measurements, on the
book's cloud (the benchmark command) and on real geometry (chapter 14's geometry
command and its benchmark variants on CAD meshes), with what adopting each choice
costs. The results page opens with it; chapter 12 derives it.

Its rows are the backends' (``Book.advice`` of :mod:`extkernels.ops.registry`, each a
list of :class:`Advice`): the reference first, then per workload in the book's order of
advice (``registry.PREFERENCE``). Whether a row's operator has an autograd formula is
read from the operator (``Backend.has_autograd``). The glossary of the variants' names
(:data:`GLOSSARY`) joins the backends' words (``Book.glossary``, in the order of their
chapters) to those of the workloads, the options and the clouds.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from . import results
from .ops import registry

__all__ = [
    "Advice",
    "Evidence",
    "GLOSSARY",  # noqa: F822  (generated when read, see __getattr__)
    "advice",
    "against_book_cloud",
    "glossary",
    "guide",
    "jit_variant",
    "search_range",
    "slowest_cloud",
    "source_lines",
    "toolchain",
    "tree",
    "worst",
]

_OPS = Path(__file__).parent / "ops"


@dataclass(frozen=True)
class Evidence:
    """The measurements a row's words quote: the benchmark command's table
    (``bench``), its variants on other clouds (``clouds``), the geometry command's
    table (``times``) and chapter 15's shipping file (``shipping``, or ``None``)."""

    bench: pd.DataFrame
    clouds: pd.DataFrame
    times: pd.DataFrame
    shipping: pd.DataFrame | None = None

    def table_of(self, variant: str) -> pd.DataFrame:
        """The benchmark's table that holds ``variant``: the book's cloud's, else the
        other clouds'."""
        return self.bench if variant in self.bench.index else self.clouds


def _not_measured(evidence: Evidence) -> str:
    return "not measured"


@dataclass(frozen=True)
class Advice:
    """One row of the guide, as a backend's book record gives it.

    Attributes:
        situation: the situation the row advises for (the table's index).
        use: what to use, in words; ``{registered}`` stands for what the operator of
            ``operation`` registers beside its kernel, read from it.
        variant: the benchmark variant whose training step and first call it quotes.
        operation: the operation whose custom operator it describes; ``None`` for
            plain PyTorch.
        geometry: its words on real geometry, from the measurements.
        reference: the row of the reference to test against (listed first).
    """

    situation: str
    use: str
    variant: str
    operation: str | None = None
    geometry: Callable[[Evidence], str] = _not_measured
    reference: bool = False

    @property
    def workload(self) -> str:
        """The workload of its variant (``"knn"`` or ``"radius"``)."""
        return self.variant.split("/")[0]


#: The parts of a variant's name that name no backend, and where the glossary lists
#: them: the workloads before the backends, the rest after.
_WORKLOADS = {
    "knn/, radius/": "the workload: the kNN projector or the radius projector"
}
_OTHER_PARTS = {
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


def glossary() -> dict[str, str]:
    """The parts of a variant's name (``workload/backend+option@cloud``) and what they
    mean: the workloads, each backend's words in the order of the chapters, then the
    floor, the options and the clouds."""
    taught = sorted(
        (b for b in registry.registered() if b.book), key=lambda b: b.book.chapter
    )
    words = dict(_WORKLOADS)
    for b in taught:
        words.update(b.book.glossary)
    return words | _OTHER_PARTS


def __getattr__(name: str):
    if name == "GLOSSARY":
        return glossary()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def advice() -> list[tuple[str, Advice]]:
    """Every row of the guide with its backend: the reference rows, then per workload
    (in the order of their first appearance) the backends in the book's order of
    advice, each with its rows in the order its record gives them."""
    this = sys.modules[__name__]
    rows = [
        (b.name, row)
        for b in registry.by_preference(registry.registered())
        if b.book and b.book.advice
        for row in b.book.advice(this)
    ]
    workloads = list(dict.fromkeys(row.workload for _, row in rows))
    return sorted(
        rows, key=lambda r: (not r[1].reference, workloads.index(r[1].workload))
    )


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
    if registry.get(backend).has_autograd(operation):
        return "with a fake and an autograd formula"
    # a search alone: the neighbours carry no gradient, PyTorch's gather after it does
    return "with a fake and no gradient formula, which the neighbours do not need"


def jit_variant(shipping: pd.DataFrame | None, backend: str) -> str | None:
    """The variant of chapter 15's shipping file whose first call builds the backend's
    libraries just in time into an empty extension cache (its name,
    ``workload/backend+option@cloud``, carries the option ``jit``); ``None`` for
    none."""
    names = [] if shipping is None else list(shipping.index)
    for name in names:
        backend_of, *options = name.split("/", 1)[-1].split("@")[0].split("+")
        if backend_of == backend and "jit" in options:
            return name
    return None


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
    jit, jit_warm = _first_calls(shipping, jit_variant(shipping, backend))
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


def worst(evidence: Evidence, method: str, n: int = 1_000_000) -> str:
    """The slowest search of a geometry method at ``n`` points, rounded up, and the
    cloud that took it."""
    ms = results.at_size(evidence.times, n, [method])[method]
    most = f"{float(results.at_most(ms.max())):,.0f}"  # a worst case rounds up
    return f"up to {most} ms per search at 10⁶ points ({ms.idxmax()})"


def search_range(evidence: Evidence, method: str, n: int = 1_000_000) -> str:
    """A geometry method's searches at ``n`` points, fastest to slowest, as a range
    that encloses them."""
    ms = results.at_size(evidence.times, n, [method])[method]
    return f"{results.at_least(ms.min())} to {results.at_most(ms.max())} ms"


def tree(evidence: Evidence) -> str:
    """The tree's search on every cloud against cuML's, and the training step in one
    CUDA graph on the CAD meshes against the book's cloud (chapter 14)."""
    times = results.tree_times(evidence.times)
    train = evidence.clouds["train_ms"]
    mesh_ratio = max(
        train[f"knn/fused+graphs@{m}"] / train["knn/fused+graphs"]
        for m in ("panda", "spitfire")
    )
    most_ms = results.at_most(times["ms at 10⁶"].max(), 2)
    least_x = results.at_least(times["x cuml at 10⁶"].min())
    return (
        f"search at most {most_ms} ms at 10⁶ points on every cloud, "
        f"{least_x}× cuML or more; "
        f"training step on CAD meshes within {results.at_most(mesh_ratio, 2)}× the "
        "book's cloud"
    )


def _radius_ratio(evidence: Evidence, method: str) -> pd.Series:
    """A radius method's time on each cloud over its time on the book's cloud."""
    return results.radius_times(evidence.times)[f"{method} / normal"]


def against_book_cloud(evidence: Evidence, method: str) -> str:
    """A radius method on every cloud against the book's cloud
    (:func:`extkernels.results.against_book_cloud`)."""
    return results.against_book_cloud(_radius_ratio(evidence, method))


def slowest_cloud(evidence: Evidence, method: str) -> str:
    """A radius method's slowest cloud against the book's, its ratio rounded up."""
    ratio = _radius_ratio(evidence, method).drop("normal")
    most = results.at_most(ratio.max(), 1)
    return f"up to {most}× its time on the book's cloud ({ratio.idxmax()})"


def guide(
    bench: pd.DataFrame,
    clouds: pd.DataFrame,
    times: pd.DataFrame,
    shipping: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """The advice, one row per situation (:func:`advice`): what to use, its training
    step on the book's cloud (``bench``, the benchmark command's table), how it fares
    on real geometry (``times``, the geometry command's table; ``clouds``, the
    benchmark's variants on other clouds) and what it costs to adopt, first calls
    included: each variant's own, and where ``shipping`` (chapter 15's file) is given,
    the libraries built just in time instead of loaded from the prebuilt wheel."""
    evidence = Evidence(bench, clouds, times, shipping)
    rows = []
    for backend, row in advice():
        table = evidence.table_of(row.variant)
        registered = _registered(backend, row.operation) if row.operation else ""
        rows.append(
            (
                row.situation,
                row.use.format(registered=registered),
                _train(table, row.variant),
                row.geometry(evidence),
                _cost(table, row.variant, backend, shipping),
            )
        )
    columns = ["situation", "use", "on the book's cloud", "on real geometry", "cost"]
    return pd.DataFrame(rows, columns=columns).set_index("situation")
