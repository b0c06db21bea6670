"""Building the C++ backend just in time (chapter 9): ``torch.utils.cpp_extension.load``
compiles the sources of ``csrc/`` into PyTorch's extension cache on first use and loads
the library, whose ``TORCH_LIBRARY`` block registers the operators
(``torch.ops.extkernels_cpp``). Where a CUDA GPU and ``nvcc`` are present the CUDA
kernels are built beside the CPU ones, for this GPU's architecture only."""

import functools
import os
import time
from pathlib import Path

import torch

__all__ = ["CSRC", "sources", "load", "build_seconds", "arch_list"]

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
