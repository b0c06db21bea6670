"""Taking the projector out of the Python process that compiled it: ``torch.export``,
AOTInductor packages, and running a package in a fresh process. The C++ operators of
chapters 9 and 11 travel as their libraries; the Python-defined ones of chapters 3 and
5 need their Python.

:func:`operator_nodes` lists the custom operators an exported program calls;
:func:`package` exports a model and compiles it into an AOTInductor package (``.pt2``);
:func:`run_fresh` loads a package in a new Python process that imports neither this
package nor the Python that defined the operators, only the operator libraries it is
given (``torch.ops.load_library``), and reports what happened: the error, or the
largest difference from the expected output and the milliseconds per call;
:func:`run_cpp` does the same from a C++ program (``csrc/aoti_run.cpp``, built just in
time by :func:`cpp_runner` with ``AOTIModelPackageLoader``), with no Python at all.

:func:`package`, :class:`Packaged` and :func:`just_in_time`, which the benchmark's
chapter-15 variants share, live in :mod:`extkernels.packaging` and are named here too.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import torch

from .. import fresh
from ..data import query_grid, reference_cloud
from ..models import KnnAggregation, Projector, RadiusAggregation
from ..ops import backends, registry
from ..packaging import Packaged, just_in_time, package
from ..problem import Problem
from ..profiling import compiler_count
from ..timing import time_blocks

__all__ = [
    "shipped",
    "SMALL_BACKENDS",
    "operator_nodes",
    "projector",
    "export_table",
    "package_table",
    "package_fresh",
    "outcome",
    "graph_table",
    "package",
    "run_fresh",
    "cpp_runner",
    "run_cpp",
    "Packaged",
    "just_in_time",
]

#: Namespaces of PyTorch's own operators (everything else is a custom operator).
TORCH_NAMESPACES = {"aten", "prims", "higher_order"}


def operator_nodes(
    ep: torch.export.ExportedProgram, *, higher_order: bool = False
) -> list[str]:
    """The custom operators the exported program's graph calls, in order, as
    ``namespace::name.overload``; with ``higher_order`` also PyTorch's higher-order
    operators (a Triton kernel's wrapper, a functionalised mutation)."""
    names = []
    for node in ep.graph.nodes:
        namespace = getattr(node.target, "namespace", None)
        if node.op != "call_function":
            continue
        if namespace not in (None, *TORCH_NAMESPACES):
            names.append(node.target.name())
        elif higher_order and namespace == "higher_order":
            names.append(node.target.name())
    return names


def shipped() -> dict[str, tuple[str, tuple[str, ...], str | None]]:
    """The projector of each backend that chapter 15 exports and packages, read from
    the registry (the backends whose book record says ``shipped``), knn ones first and
    each workload's in the order of their chapters: backend -> (its workload, the
    backends whose operator libraries a package of it needs, the Python module that
    defines its operators or ``None``)."""
    ships = [b for b in registry.registered() if b.book and b.book.shipped]
    ships.sort(key=lambda b: (b.book.shipped != "knn", b.book.chapter))
    return {
        b.name: (b.book.shipped, tuple(b.libraries), b.python_module) for b in ships
    }


def projector(backend: str, prob: Problem) -> tuple[torch.nn.Module, tuple]:
    """The projector of ``backend`` (its workload of :func:`shipped`) at ``prob``'s
    sizes, in eval mode, run once (which loads its library before any trace), and its
    inputs ``(p_query, p_ref)``."""
    workload = shipped()[backend][0]
    p_ref = reference_cloud(
        prob.cloud_size(workload), seed=prob.seed, device=prob.device
    )
    p_query = query_grid(prob.grid_side, device=prob.device)
    if workload == "knn":
        aggregation = KnnAggregation(prob.k, prob.sigma, backend)
    else:
        aggregation = RadiusAggregation(prob.radius, prob.sigma, backend)
    torch.manual_seed(prob.seed)
    model = Projector(aggregation, prob.hidden).to(prob.device).eval()
    with torch.no_grad():
        model(p_query, p_ref)
    return model, (p_query, p_ref)


def _here() -> list[str]:
    return [b for b, (w, _, _) in shipped().items() if b in backends(f"{w}_aggregate")]


def export_table(prob: Problem) -> pd.DataFrame:
    """Each backend's projector that runs here, exported: the custom operators its
    graph calls, and those left after ``run_decompositions`` (higher-order operators
    included)."""

    def listed(names: list[str]) -> str:
        return ", ".join(names) or "none: ATen only"

    rows = {}
    for backend in _here():
        model, inputs = projector(backend, prob)
        ep = torch.export.export(model, inputs)
        decomposed = ep.run_decompositions()
        rows[backend] = {
            "exported": listed(operator_nodes(ep)),
            "after run_decompositions": listed(
                operator_nodes(decomposed, higher_order=True)
            ),
        }
    return pd.DataFrame(rows).T.rename_axis("backend")


def outcome(ran: dict) -> str:
    """A run of :func:`run_fresh` or :func:`run_cpp` in words: "runs" with the largest
    difference from the expected output, or the error's first line without its type."""
    if ran["error"]:
        return ran["error"].removeprefix("RuntimeError: ")
    return f"runs (max |diff| {ran['max_abs_diff']:.0e})"


#: The backends :func:`package_table` packages for a ``small`` problem (on a CPU): one
#: per lesson of the table. A C++ operator needs its library (``cpp``; ``fused`` needs
#: two, the same lesson), an operator defined in Python needs that Python (``warp``;
#: ``cuml`` and ``ptx``, whose gather is defined in Python, teach it again), and a
#: ``triton_op`` needs nothing, as PyTorch's own operators (``torch``) need nothing.
SMALL_BACKENDS = ("triton", "cpp", "warp")
#: The backends :func:`package_table` packages and runs at once.
FRESH_AT_ONCE = 4


def package_table(
    prob: Problem, folder: Path, backends: Sequence[str] | None = None
) -> pd.DataFrame:
    """Each backend's projector, packaged into ``folder`` and run in fresh processes
    (:func:`outcome`): with nothing loaded, then with its operator libraries where it
    has any, then with those and the Python module that defines its operators where it
    has one. One row per run, indexed by backend and what was loaded (a long table, so
    that error messages wrap on a page).

    ``backends``: those to package, in order; by default every backend that runs here
    or, for a ``small`` problem (the CPU run), only those of :data:`SMALL_BACKENDS`
    that run here, one backend per lesson: a C++ operator needs its library, one
    defined in Python needs that Python, a ``triton_op`` needs nothing. Nothing is
    timed (the table shows outcomes only), so :data:`FRESH_AT_ONCE` backends are
    packaged side by side, each in a fresh process (:func:`package_fresh`), and then
    run."""
    if backends is None:
        backends = [b for b in _here() if not prob.small or b in SMALL_BACKENDS]
    every = shipped()
    unknown = sorted(set(backends) - set(every))
    if unknown:
        raise ValueError(f"backends: expected some of {list(every)}, got {unknown}")
    # built here, once, before the fresh processes load them
    libraries = {
        b: [str(registry.get(n).library()) for n in every[b][1]] for b in backends
    }
    sizes = {**asdict(prob), "device": str(prob.device)}

    def runs(backend: str) -> list[dict]:
        _, libs, module = every[backend]
        pt2, data = fresh.call(__name__, "package_fresh", backend, sizes, str(folder))
        loads = [("nothing", {})]
        if libs:
            loads.append(("its libraries", {"libraries": libraries[backend]}))
        if module:
            both = {"libraries": libraries[backend], "imports": [module]}
            loads.append(("and its Python", both))
        return [
            {
                "backend": backend,
                "loaded": name,
                "outcome": outcome(_run_saved(pt2, data, **given)),
            }
            for name, given in loads
        ]

    with ThreadPoolExecutor(max_workers=FRESH_AT_ONCE) as pool:
        rows = [row for ran in pool.map(runs, backends) for row in ran]
    return pd.DataFrame(rows).set_index(["backend", "loaded"])


def package_fresh(backend: str, sizes: dict, folder: str) -> tuple[str, str]:
    """What a fresh process of :func:`package_table` does: ``backend``'s projector at
    the problem ``sizes`` (a :class:`~extkernels.problem.Problem`'s fields) packaged
    into ``folder``, with its inputs and output saved beside it for :func:`run_fresh`'s
    child: the paths of the package and of those tensors."""
    prob = Problem(**{**sizes, "device": torch.device(sizes["device"])})
    model, inputs = projector(backend, prob)
    with torch.no_grad():
        expected = model(*inputs)
    pt2 = package(model, inputs, Path(folder) / f"{backend}.pt2")
    data = _save(Path(folder) / f"{backend}.pt", inputs, expected)
    return str(pt2), str(data)


#: The file a fresh process of :func:`run_fresh` loads: it imports PyTorch only.
_CHILD = str(Path(__file__).with_name("package_run.py"))


def run_fresh(
    pt2: Path,
    inputs: tuple,
    expected: torch.Tensor,
    *,
    libraries: list[Path] = (),
    imports: list[str] = (),
    seconds: float | None = 0.5,
) -> dict:
    """Load the package ``pt2`` in a new Python process after loading ``libraries``
    (operator libraries, in order) and importing ``imports`` (Python modules), run it
    on ``inputs`` and time it for about ``seconds`` (``None``: not at all).

    Returns:
        ``error``: ``None``, or the exception's type and first line where loading or
        the first call failed; otherwise ``max_abs_diff`` from ``expected`` and ``ms``
        per call (median of ``torch.utils.benchmark``'s blocks; ``None`` where
        ``seconds`` is).

    Raises:
        extkernels.fresh.FreshProcessError: the process failed before it reached the
            package (a library that does not load, a module that does not import).
    """
    with tempfile.TemporaryDirectory() as tmp:
        data = _save(Path(tmp) / "data.pt", inputs, expected)
        return _run_saved(
            pt2, data, libraries=libraries, imports=imports, seconds=seconds
        )


def _save(path: Path, inputs: tuple, expected: torch.Tensor) -> Path:
    """The inputs and expected output a child of :func:`_run_saved` reads."""
    torch.save({"inputs": inputs, "expected": expected}, path)
    return path


def _run_saved(pt2, data, *, libraries=(), imports=(), seconds=None) -> dict:
    """:func:`run_fresh` on inputs already saved in ``data`` (:func:`_save`)."""
    return fresh.call(
        _CHILD,
        "run",
        str(pt2),
        str(data),
        libraries=[str(p) for p in libraries],
        imports=list(imports),
        seconds=seconds,
    )


def cpp_runner(verbose: bool = False) -> Path:
    """The C++ program of ``csrc/aoti_run.cpp``, built just in time against this
    PyTorch's libraries (``torch.utils.cpp_extension.load`` with ``is_standalone``)."""
    from torch.utils import cpp_extension

    return Path(
        cpp_extension.load(
            name="extkernels_aoti_run",
            sources=[str(Path(__file__).parent / "csrc" / "aoti_run.cpp")],
            extra_cflags=["-O2"],
            is_python_module=False,
            is_standalone=True,
            verbose=verbose,
        )
    )


def run_cpp(
    pt2: Path, inputs: tuple, expected: torch.Tensor, *, libraries: list[Path] = ()
) -> dict:
    """Run the package ``pt2`` from :func:`cpp_runner`'s program after it loads
    ``libraries``: ``first_call_s`` (the loader's constructor and the first call),
    ``max_abs_diff`` from ``expected`` and ``ms`` per later call (50 calls); ``error``,
    the first line of the error where the load or the first call failed. On a GPU the
    program loads PyTorch's CUDA library first, which the C++ API does not load by
    itself."""
    program = cpp_runner()
    device = expected.device.type
    lib = Path(torch.__file__).parent / "lib"
    first = [lib / "libtorch_cuda.so"] if device == "cuda" else []
    # the package's own library names PyTorch's libraries without a path
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}",
    }
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.pt"
        torch.save((*(t.cpu() for t in (*inputs, expected)), device), data)
        done = subprocess.run(
            [str(program), str(pt2), str(data), *map(str, [*first, *libraries])],
            capture_output=True,
            text=True,
            env=env,
        )
    if done.returncode:
        lines = (done.stderr.strip() or "no error output").splitlines()
        return {"error": lines[-1]}
    return {"error": None, **json.loads(done.stdout.splitlines()[-1])}


def graph_table(calls: dict[str, Callable[[], object]], n_iters: int) -> pd.DataFrame:
    """Calls of functions compiled with ``mode="reduce-overhead"``: whether the CUDA
    graph trees replay each as a graph or skip it (``torch._dynamo``'s counter of
    skips, over its first three calls), and its milliseconds per call in this process
    (:func:`~extkernels.timing.time_blocks`: median, fastest and slowest of five
    blocks of ``n_iters`` calls)."""
    rows = {}
    for name, call in calls.items():
        before = compiler_count("inductor", "cudagraph_skips")
        for _ in range(3):  # compile, record, replay
            call()
        skipped = compiler_count("inductor", "cudagraph_skips") > before
        ms, lo, hi = time_blocks(call, n_iters)
        rows[name] = {
            "CUDA graph": "skipped" if skipped else "replayed",
            "ms per call": ms,
            "fastest": lo,
            "slowest": hi,
        }
    return pd.DataFrame(rows).T.rename_axis("search")
