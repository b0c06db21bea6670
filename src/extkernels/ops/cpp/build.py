"""Building the C++ backend just in time (chapter 9): ``torch.utils.cpp_extension.load``
compiles the sources of ``csrc/`` into PyTorch's extension cache on first use and loads
the library, whose ``TORCH_LIBRARY`` block registers the operators
(``torch.ops.extkernels_cpp``). Where a CUDA GPU and ``nvcc`` are present the CUDA
kernels are built beside the CPU ones, for this GPU's architecture only. Where the
``extkernels-native`` wheel holds a library built from these sources for this PyTorch,
it is loaded instead (:mod:`~extkernels.ops.prebuilt`)."""

import contextlib
import functools
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import torch

from .. import prebuilt
from ..onload import OnLoad

__all__ = [
    "CSRC",
    "sources",
    "load",
    "is_loaded",
    "on_load",
    "build_seconds",
    "prebuilt_path",
    "library_file",
    "arch_list",
    "arch_environment",
    "summary",
    "stable_coverage",
]

CSRC = Path(__file__).parent / "csrc"

#: Seconds the first :func:`load` of this process took (a build, a cache hit, or the
#: prebuilt library's load).
build_seconds: float | None = None
#: The prebuilt library :func:`load` loaded, or ``None`` where it built just in time.
prebuilt_path: Path | None = None
#: The registrations on the operators that wait for :func:`load` (:mod:`~.ops` declares
#: them).
on_load = OnLoad()


def sources(cuda: bool) -> list[Path]:
    """The files compiled: the schemas and CPU kernels, and with ``cuda`` the CUDA
    kernels."""
    files = [CSRC / "knn.cpp"]
    return files + [CSRC / "knn_cuda.cu"] if cuda else files


def _with_cuda() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.cuda.is_available() and CUDA_HOME is not None


def arch_list() -> str | None:
    """The GPU architectures just-in-time builds compile the CUDA kernels for: this
    GPU's, unless ``TORCH_CUDA_ARCH_LIST`` says otherwise (``None`` without CUDA).
    Reads the environment, never writes it (:func:`arch_environment` does, for a
    build)."""
    if not _with_cuda():
        return None
    if "TORCH_CUDA_ARCH_LIST" in os.environ:
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"  # this GPU only


@contextlib.contextmanager
def arch_environment() -> Iterator[str | None]:
    """``TORCH_CUDA_ARCH_LIST`` set to :func:`arch_list` while a build runs (PyTorch's
    ``cpp_extension`` reads the architectures from there), and restored after; yields
    the list (``None`` without CUDA, and the environment untouched)."""
    arch = arch_list()
    before = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch is not None:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    try:
        yield arch
    finally:
        if before is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = before


@functools.cache
def load(verbose: bool = False) -> None:
    """Load the prebuilt library, or compile (or find in the cache) and load the
    extension, then make the registrations of :data:`on_load`; once per process."""
    global build_seconds, prebuilt_path
    start = time.perf_counter()
    prebuilt_path = prebuilt.load("cpp", [CSRC], [])
    if prebuilt_path is None:
        _build(verbose)
    build_seconds = time.perf_counter() - start
    on_load.run()


def is_loaded() -> bool:
    """Whether :func:`load` has loaded the library in this process."""
    return on_load.loaded


def library_file() -> Path:
    """The file of the library :func:`load` loaded: what another process loads with
    ``torch.ops.load_library`` to run these operators without this package (an
    AOTInductor package that calls them, for example)."""
    load()
    return prebuilt_path or prebuilt.loaded("extkernels_cpp")


def _build(verbose: bool) -> None:
    from torch.utils import cpp_extension

    with arch_environment() as arch:
        cuda = arch is not None
        cpp_extension.load(
            name="extkernels_cpp_cuda" if cuda else "extkernels_cpp",
            sources=[str(p) for p in sources(cuda)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-lineinfo"],
            with_cuda=cuda,
            is_python_module=False,
            verbose=verbose,
        )


def summary() -> pd.DataFrame:
    """What :func:`load` built or found in this process (chapter 9): the sources
    compiled, ``TORCH_CUDA_ARCH_LIST`` (``"(CPU only)"`` without CUDA) and the seconds
    the first load took, as one column named ``extension``."""
    if build_seconds is None:
        raise RuntimeError(
            "summary: the extension is not loaded yet; call load() first"
        )
    rows = {
        "sources": ", ".join(p.name for p in sources(_with_cuda())),
        "TORCH_CUDA_ARCH_LIST": arch_list() or "(CPU only)",
        "seconds to build or load": round(build_seconds, 1),
    }
    return pd.Series(rows, name="extension").to_frame()


def stable_coverage(dirs: list[Path] | None = None) -> pd.DataFrame:
    """The ATen functions the sources call (``at::name(``), and whether the ABI-stable
    API (``torch/csrc/stable/ops.h``, PyTorch >= 2.9) offers a function of that name:
    what porting the extension to ``STABLE_TORCH_LIBRARY`` would have to replace.

    Args:
        dirs: the source folders to read (default: this library's ``csrc/``; the fused
            library's are its own and this one's).

    Returns:
        DataFrame indexed by function, with ``calls`` (in the sources) and ``in
        torch::stable`` (bool; all false where this PyTorch ships no stable
        headers).
    """
    from torch.utils.cpp_extension import include_paths

    calls: dict[str, int] = {}
    for path in sorted(p for d in dirs or [CSRC] for p in Path(d).iterdir()):
        for name in re.findall(r"\bat::([a-z_]+)\(", path.read_text()):
            calls[name] = calls.get(name, 0) + 1
    headers = [Path(p) / "torch/csrc/stable/ops.h" for p in include_paths()]
    stable = {
        name
        for h in headers
        if h.exists()
        for name in re.findall(r"^inline [\w:<>, ]+? (\w+)\(", h.read_text(), re.M)
    }
    out = pd.DataFrame(
        {"calls": calls, "in torch::stable": {n: n in stable for n in calls}}
    )
    return out.rename_axis("at:: function").sort_values("calls", ascending=False)
