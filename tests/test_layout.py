"""The package's shape: layers that import only downwards, experiments that are
leaves, no import circle, small modules, and docstrings that name chapters which
exist."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "extkernels"
MAX_LINES = 400
#: The experiment layers: what drives the chapters and the benchmark. Library layers
#: (data, models, ops, training, timing, graphs, profiling, plotting, variants, ...)
#: never import them.
EXPERIMENTS = (
    "extkernels.benchmark",
    "extkernels.campaign",  # runs the benchmark, the other commands and the chapters
    "extkernels.datafiles",  # the campaign's data files, from the benchmark's runs
    "extkernels.experiments",
    "extkernels.distributed.report",  # chapter 13's tables, from chapter 12's crossover
)
#: The experiments proper: leaves of the import graph, each importing only the library
#: layers (never the variants, the commands that drive them, or one another).
LEAVES = ("extkernels.experiments", "extkernels.distributed.report")
#: What no leaf imports beside the experiment layers: the benchmark's variants.
VARIANTS = "extkernels.variants"
#: Imports inside functions, each for a reason. Beside these, a backend may import its
#: own modules inside functions (see :func:`_inside_one_backend`): it defers its heavy
#: parts, an optional library or a build, to first use.
LAZY: dict[tuple[str, str], str] = {}
#: Optional libraries that importing the package must not import, and modules of the
#: backends that build or load compiled code on import (their backends defer them to
#: first use): what the lazy imports above are for. The C++ backends' modules build
#: and load nothing on import (their ``load()`` does, on first use: see
#: :func:`test_importing_builds_and_loads_no_library`).
DEFERRED = (
    "warp",
    "cuml",
    "cupy",
    "rmm",
    "cuvs",
    "extkernels.ops.warp.kernels",
)


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> list[str]:
    """The package's modules an ``ImportFrom`` names (``from . import x`` may name
    modules)."""
    if node.level:
        base = module.split(".")
        if path.name != "__init__.py":
            base = base[:-1]
        base = base[: len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    submodules = [
        f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES
    ]
    # ``from pkg import submodule`` depends on the submodule; the package is its parent
    # anyway. Any other name comes from the package's own __init__.
    whole = target in MODULES and len(submodules) < len(node.names)
    return ([target] if whole else []) + submodules


def _imports(module: str) -> list[tuple[str, bool]]:
    """``(imported module of the package, inside a function)`` for every import in
    ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef
            )
            if isinstance(child, ast.ImportFrom):
                out.extend((m, in_function) for m in _resolve(module, path, child))
            elif isinstance(child, ast.Import):
                out.extend(
                    (a.name, in_function) for a in child.names if a.name in MODULES
                )
            visit(child, inner)

    visit(tree, False)
    return [(m, lazy) for m, lazy in out if m != module]


GRAPH = {m: _imports(m) for m in MODULES}
#: The backends' folders: every subpackage of ``extkernels.ops``.
BACKENDS = sorted(
    m
    for m, path in MODULES.items()
    if m.startswith("extkernels.ops.")
    and m.count(".") == 2
    and path.name == "__init__.py"
)


def _backend_of(module: str) -> str | None:
    """The backend folder ``module`` lies in, or ``None``."""
    return next(
        (b for b in BACKENDS if module == b or module.startswith(b + ".")), None
    )


def _inside_one_backend(module: str, dep: str) -> bool:
    return _backend_of(module) is not None and _backend_of(module) == _backend_of(dep)


def _is_experiment(module: str) -> bool:
    return any(module == e or module.startswith(e + ".") for e in EXPERIMENTS)


def test_the_import_graph_has_no_circle():
    state: dict[str, str] = {}

    def visit(m: str, trail: list[str]) -> None:
        state[m] = "open"
        for dep, _ in GRAPH[m]:
            if state.get(dep) == "open":
                circle = trail[trail.index(dep) :] + [dep] if dep in trail else [m, dep]
                pytest.fail("import circle: " + " -> ".join(circle))
            if dep not in state:
                visit(dep, trail + [dep])
        state[m] = "done"

    for m in MODULES:
        if m not in state:
            visit(m, [m])


@pytest.mark.parametrize("module", [m for m in MODULES if not _is_experiment(m)])
def test_library_layers_do_not_import_experiments(module):
    up = [dep for dep, _ in GRAPH[module] if _is_experiment(dep)]
    assert not up, f"{module} imports the experiment layer: {up}"


def _is_leaf(module: str) -> bool:
    return any(module == e or module.startswith(e + ".") for e in LEAVES)


@pytest.mark.parametrize("module", [m for m in MODULES if _is_leaf(m)])
def test_experiments_import_neither_the_variants_nor_one_another(module):
    up = [
        dep
        for dep, _ in GRAPH[module]
        if dep == VARIANTS or (_is_experiment(dep) and dep != "extkernels.experiments")
    ]
    assert not up, (
        f"{module} imports {up}: an experiment is a leaf (move what it shares down "
        "into the package)"
    )


def test_the_leaves_are_found():
    leaves = [m for m in MODULES if _is_leaf(m)]
    assert "extkernels.experiments.shipping" in leaves
    assert "extkernels.distributed.report" in leaves
    assert not _is_experiment(VARIANTS)


@pytest.mark.parametrize("module", list(MODULES))
def test_imports_of_the_package_sit_at_the_top_of_modules(module):
    hidden = [
        dep
        for dep, lazy in GRAPH[module]
        if lazy and (module, dep) not in LAZY and not _inside_one_backend(module, dep)
    ]
    assert not hidden, f"{module} imports {hidden} inside a function"


def test_every_folder_of_ops_is_a_backend_registered_under_its_name():
    import importlib

    from extkernels.ops import registry

    assert BACKENDS, "no backend folder found"
    for module in BACKENDS:
        folder = module.rsplit(".", 1)[1]
        backend = getattr(importlib.import_module(module), "BACKEND", None)
        assert isinstance(backend, registry.Backend), (
            f"{module}: a folder of ops/ is a backend; its __init__ registers one as "
            "BACKEND"
        )
        assert backend.name == folder, (
            f"{module}: registers {backend.name!r}; a backend is named like its folder "
            "(the guide counts its lines there)"
        )
        assert registry.get(folder) is backend


def test_no_module_names_a_backend_to_register_it():
    # extkernels.ops finds the backends' folders itself: adding one edits no other file.
    named = [dep for dep, _ in GRAPH["extkernels.ops"] if _backend_of(dep)]
    assert not named, f"extkernels.ops imports {named}: it should find them"


@pytest.mark.slow
def test_importing_the_package_defers_what_its_backends_defer():
    code = (
        "import sys, extkernels; "
        f"print([m for m in {list(DEFERRED)!r} if m in sys.modules])"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "[]", (
        f"imported by `import extkernels`: {child.stdout}"
    )


#: Run with an empty extension cache and the prebuilt wheel unused: import the package
#: and every module of each backend that runs here, ask which backends run, check a
#: call's metadata; then report what was built and loaded.
NOTHING_LOADED = """
import importlib, json, os, pkgutil
import torch
import extkernels as ek
from extkernels.ops import fused, registry
from extkernels.ops.cpp import build as cpp_build
from extkernels.ops.fused import build as fused_build

for b in registry.registered():
    if b.available():
        package = importlib.import_module(f"extkernels.ops.{b.name}")
        for found in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{found.name}")
report = {"knn": ek.backends("knn"), "radius": ek.backends("radius_aggregate")}
q, r = ek.query_grid(3), ek.reference_cloud(50, seed=0)
try:
    fused.knn_out(q, r, 3, torch.empty(27, 4), torch.empty(27, 3, dtype=torch.int64))
except ValueError as e:
    report["refused"] = str(e)
report["built"] = os.listdir(os.environ["TORCH_EXTENSIONS_DIR"])
report["loaded"] = [
    os.path.basename(p) for p in torch.ops.loaded_libraries if "extkernels" in p
]
report["flags"] = [cpp_build.is_loaded(), fused_build.is_loaded()]
report["operators"] = [
    hasattr(torch.ops.extkernels_cpp, "knn"), hasattr(torch.ops.extkernels_fused, "knn")
]
print(json.dumps(report))
"""


@pytest.mark.slow
def test_importing_builds_and_loads_no_library(tmp_path):
    import json
    import os

    cache = tmp_path / "extensions"
    cache.mkdir()
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(cache), EXTKERNELS_PREBUILT="0")
    child = subprocess.run(
        [sys.executable, "-c", NOTHING_LOADED],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.splitlines()[-1])
    assert report["built"] == [] and report["loaded"] == [], report
    assert report["flags"] == [False, False], "a build module says it loaded"
    assert report["operators"] == [False, False], "an operator exists: a library loaded"
    # the buffers' metadata is refused before anything is built
    assert report["refused"].startswith("distances: expected"), report
    assert "torch" in report["knn"] and "torch" in report["radius"], report


@pytest.mark.parametrize("module", list(MODULES))
def test_no_module_is_over_the_line_limit(module):
    n = len(MODULES[module].read_text().splitlines())
    assert n <= MAX_LINES, (
        f"{module}: {n} lines (at most {MAX_LINES}: split it by role)"
    )


#: The most lines of a native source file (CUDA or C++): past it, a file holds two jobs.
MAX_NATIVE_LINES = 600
NATIVE = sorted(
    p for ext in ("*.cu", "*.cuh", "*.cpp", "*.h") for p in (SRC / PACKAGE).rglob(ext)
)


@pytest.mark.parametrize("path", NATIVE, ids=lambda p: p.name)
def test_no_native_source_is_over_its_line_limit(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_NATIVE_LINES, (
        f"{path.name}: {n} lines (at most {MAX_NATIVE_LINES}: split it by job)"
    )


def _chapters() -> set[int]:
    return {int(p.name[:2]) for p in (ROOT / "book").glob("[0-9][0-9]_*.ipynb")}


@pytest.mark.parametrize("module", list(MODULES))
def test_module_docstring_names_chapters_that_exist(module):
    doc = ast.get_docstring(ast.parse(MODULES[module].read_text())) or ""
    named = [int(n) for n in re.findall(r"[Cc]hapters?\s+(\d+)", doc)]
    named += [int(n) for n in re.findall(r"[Cc]hapters\s+\d+-(\d+)", doc)]
    assert named, f"{module}: the docstring names no chapter that teaches it"
    missing = sorted(set(named) - _chapters())
    assert not missing, f"{module}: names chapters {missing}, which do not exist"


def test_no_source_file_names_a_chapter_that_does_not_exist():
    for path in MODULES.values():
        for n in re.findall(r"[Cc]hapters?\s+(\d+)", path.read_text()):
            assert int(n) in _chapters(), (
                f"{path.relative_to(ROOT)}: chapter {n} does not exist"
            )
