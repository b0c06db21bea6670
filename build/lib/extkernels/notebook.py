"""Helpers for the first cells of every chapter (chapter 1 onward): versions, hardware
and showing package code."""

from __future__ import annotations

import importlib.metadata as md
import inspect
import os
import platform
import subprocess
from pathlib import Path

import pandas as pd
import torch

__all__ = ["versions", "show_source", "cpp_excerpt", "show_cpp", "fake_tensors"]

# (label, distribution names to try): the CUDA 12 and CUDA 13 builds have different
# names.
_PACKAGES = [
    ("torch", ("torch",)),
    ("triton", ("triton", "pytorch-triton")),
    ("warp", ("warp-lang",)),
    ("cuml", ("cuml-cu12", "cuml-cu13", "cuml")),
    ("rmm", ("rmm-cu12", "rmm-cu13", "rmm")),
    ("cupy", ("cupy-cuda12x", "cupy-cuda13x", "cupy")),
    ("pyptx", ("pyptx",)),
]


def _version(names: tuple[str, ...]) -> str:
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return "not installed"


def _driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "n/a"


def _host_cpu() -> str:
    """The host's processor model and core count: host-bound timings (a launch, a
    Python backward) depend on it as much as on the GPU."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            line.split(":", 1)[1].strip()
            for line in cpuinfo.read_text().splitlines()
            if line.startswith("model name")
        ]
        model = names[0] if names else model
    return f"{model} ({os.cpu_count()} cores)"


def versions() -> pd.DataFrame:
    """The software and hardware this notebook runs on, one row each."""
    rows = [("python", platform.python_version())]
    # torch's own version string names its build (+cu130, +cpu); the package metadata
    # may not.
    rows += [
        (label, torch.__version__ if label == "torch" else _version(names))
        for label, names in _PACKAGES
    ]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        rows += [
            (
                "device",
                f"{props.name} ({props.total_memory / 2**30:.0f} GiB, "
                f"sm_{props.major}{props.minor})",
            ),
            ("CUDA (torch)", torch.version.cuda or "n/a"),
            ("driver", _driver()),
        ]
    else:
        rows += [("device", "CPU only (the host CPU below)")]
    rows.append(("host CPU", _host_cpu()))
    return pd.DataFrame(rows, columns=["component", "version"]).set_index("component")


def show_source(obj) -> object:
    """The source code of a package function or class, rendered as a highlighted
    block."""
    from IPython.display import Code

    return Code(inspect.getsource(decorated(obj)), language="python")


def cpp_excerpt(path, start: str) -> str:
    """The C++ declaration in file ``path`` that begins on the first line containing
    ``start`` (a function, a struct, a ``TORCH_LIBRARY`` block), with the comment and
    ``template`` lines just above it: up to the brace that closes it."""
    lines = Path(path).read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if start in line)
    while first > 0 and lines[first - 1].lstrip().startswith(("//", "template <")):
        first -= 1
    depth, opened = 0, False
    for last in range(first, len(lines)):
        code = lines[last].split("//")[0]
        depth += code.count("{") - code.count("}")
        opened = opened or "{" in code
        if opened and depth == 0:
            break
    return "\n".join(lines[first : last + 1])


def show_cpp(path, start: str) -> object:
    """:func:`cpp_excerpt`, rendered as a highlighted block."""
    from IPython.display import Code

    return Code(cpp_excerpt(path, start), language="cpp")


def ptx_excerpt(text: str, start: str, end: str | None = None) -> str:
    """The lines of PTX ``text`` from the first containing ``start`` up to (without)
    the first after it containing ``end`` (to the end without one)."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if start in line)
    last = len(lines)
    if end is not None:
        last = next(i for i in range(first + 1, len(lines)) if end in lines[i])
    return "\n".join(lines[first:last])


def show_ptx(text: str, start: str, end: str | None = None) -> object:
    """:func:`ptx_excerpt`, rendered as a highlighted block."""
    from IPython.display import Code

    return Code(ptx_excerpt(text, start, end), language="ptx")


def decorated(obj):
    """The Python function behind a decorated one: a Warp kernel or function keeps it
    as ``func``, a Triton kernel (or Triton's interpreter running one) as ``fn``
    (anything else is returned as it is). The chapters type their operators'
    registrations, so no listing shows a custom operator."""
    if getattr(obj, "func", None) is not None:
        return obj.func
    triton_kernel = type(obj).__name__ in ("JITFunction", "InterpretedFunction")
    if triton_kernel and callable(getattr(obj, "fn", None)):
        return obj.fn
    return obj


def fake_tensors():
    """The mode ``torch.compile`` traces in (chapter 3): tensors that carry shape, dtype
    and device but no data, so that an operator called on them runs its fake.
    PyTorch's ``FakeTensorMode``, as a context manager."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()
