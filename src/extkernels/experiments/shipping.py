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
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

__all__ = ["operator_nodes", "package", "run_fresh", "cpp_runner", "run_cpp"]

#: Namespaces of PyTorch's own operators (everything else is a custom operator).
TORCH_NAMESPACES = {"aten", "prims", "higher_order"}


def operator_nodes(ep: torch.export.ExportedProgram) -> list[str]:
    """The custom operators the exported program's graph calls, in order, as
    ``namespace::name.overload``."""
    names = []
    for node in ep.graph.nodes:
        namespace = getattr(node.target, "namespace", None)
        if node.op == "call_function" and namespace not in (None, *TORCH_NAMESPACES):
            names.append(node.target.name())
    return names


def package(model: torch.nn.Module, inputs: tuple, path: Path) -> Path:
    """``model`` (in eval mode) exported on ``inputs`` and compiled by AOTInductor into
    the package ``path`` (``.pt2``)."""
    ep = torch.export.export(model.eval(), inputs)
    return Path(torch._inductor.aoti_compile_and_package(ep, package_path=str(path)))


_FRESH = textwrap.dedent(
    """
    import importlib, json, sys
    import torch
    from torch.utils import benchmark

    args = json.loads(sys.argv[1])
    for library in args["libraries"]:
        torch.ops.load_library(library)
    for module in args["imports"]:
        importlib.import_module(module)
    data = torch.load(args["data"])
    try:
        runner = torch._inductor.aoti_load_package(args["package"])
        out = runner(*data["inputs"])
    except Exception as e:
        print(json.dumps({"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}))
        sys.exit(0)
    timer = benchmark.Timer(
        "runner(*inputs)", globals={"runner": runner, "inputs": data["inputs"]}
    )
    ms = timer.blocked_autorange(min_run_time=args["seconds"]).median * 1e3
    diff = (out - data["expected"]).abs().max().item()
    print(json.dumps({"error": None, "max_abs_diff": diff, "ms": ms}))
    """
)


def run_fresh(
    pt2: Path,
    inputs: tuple,
    expected: torch.Tensor,
    *,
    libraries: list[Path] = (),
    imports: list[str] = (),
    seconds: float = 0.5,
) -> dict:
    """Load the package ``pt2`` in a new Python process after loading ``libraries``
    (operator libraries, in order) and importing ``imports`` (Python modules), run it
    on ``inputs`` and time it for about ``seconds``.

    Returns:
        ``error``: ``None``, or the exception's type and first line where loading or
        the first call failed; otherwise ``max_abs_diff`` from ``expected`` and ``ms``
        per call (median of ``torch.utils.benchmark``'s blocks).
    """
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.pt"
        torch.save({"inputs": inputs, "expected": expected}, data)
        args = {
            "package": str(pt2),
            "libraries": [str(p) for p in libraries],
            "imports": list(imports),
            "data": str(data),
            "seconds": seconds,
        }
        done = subprocess.run(
            [sys.executable, "-c", _FRESH, json.dumps(args)],
            capture_output=True,
            text=True,
        )
    if done.returncode:
        raise RuntimeError(f"run_fresh: the process failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


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
    the first line of the error where the load or the first call failed."""
    program = cpp_runner()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.pt"
        torch.save((*inputs, expected), data)
        done = subprocess.run(
            [str(program), str(pt2), str(data), *map(str, libraries)],
            capture_output=True,
            text=True,
        )
    if done.returncode:
        lines = (done.stderr.strip() or "no error output").splitlines()
        return {"error": lines[-1]}
    return {"error": None, **json.loads(done.stdout.splitlines()[-1])}
