"""Building the C++ backend just in time (chapter 9): ``torch.utils.cpp_extension.load``
compiles the sources of ``csrc/`` into PyTorch's extension cache on first use and loads
the library, whose ``TORCH_LIBRARY`` block registers the operators
(``torch.ops.extkernels_cpp``). Where a CUDA GPU and ``nvcc`` are present the CUDA
kernels are built beside the CPU ones, for this GPU's architecture only."""

import functools
import os
import re
import time
from pathlib import Path

import pandas as pd
import torch

__all__ = [
    "CSRC",
    "sources",
    "load",
    "build_seconds",
    "arch_list",
    "summary",
    "stable_coverage",
]

CSRC = Path(__file__).parent / "csrc"

#: Seconds the first :func:`load` of this process took (a build, or a cache hit).
build_seconds: float | None = None


def sources(cuda: bool) -> list[Path]:
    """The files compiled: the schemas and CPU kernels, and with ``cuda`` the CUDA
    kernels."""
    files = [CSRC / "knn.cpp"]
    return files + [CSRC / "knn_cuda.cu"] if cuda else files


def _with_cuda() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.cuda.is_available() and CUDA_HOME is not None


def arch_list() -> str | None:
    """The GPU architectures the CUDA kernels are built for (``None`` without CUDA)."""
    return os.environ.get("TORCH_CUDA_ARCH_LIST") if _with_cuda() else None


@functools.cache
def load(verbose: bool = False) -> None:
    """Compile (or find in the cache) and load the extension, once per process."""
    global build_seconds
    from torch.utils import cpp_extension

    cuda = _with_cuda()
    if cuda and "TORCH_CUDA_ARCH_LIST" not in os.environ:
        major, minor = torch.cuda.get_device_capability()
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"  # this GPU only
    start = time.perf_counter()
    cpp_extension.load(
        name="extkernels_cpp_cuda" if cuda else "extkernels_cpp",
        sources=[str(p) for p in sources(cuda)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-lineinfo"],
        with_cuda=cuda,
        is_python_module=False,
        verbose=verbose,
    )
    build_seconds = time.perf_counter() - start


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


def stable_coverage() -> pd.DataFrame:
    """The ATen functions the sources call (``at::name(``), and whether the ABI-stable
    API (``torch/csrc/stable/ops.h``, PyTorch >= 2.9) offers a function of that name:
    what porting the extension to ``STABLE_TORCH_LIBRARY`` would have to replace.

    Returns:
        DataFrame indexed by function, with ``calls`` (in the sources) and ``in
        torch::stable`` (bool; all false where this PyTorch ships no stable
        headers).
    """
    from torch.utils.cpp_extension import include_paths

    calls: dict[str, int] = {}
    for path in sorted(CSRC.iterdir()):
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
