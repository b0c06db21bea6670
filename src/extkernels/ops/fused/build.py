"""Building the fused backend just in time (chapter 11), the way chapter 9 builds the
C++ backend: ``torch.utils.cpp_extension.load`` compiles ``csrc/`` into PyTorch's
extension cache, for this GPU only. Chapter 9's library is loaded first: the fused CPU
kernels reach its kernels through the dispatcher. Where the ``extkernels-native``
wheel holds a library built from these sources and constants for this PyTorch, it is
loaded instead (:mod:`~extkernels.ops.prebuilt`). :data:`on_load` then registers the
operators' Python half (:mod:`~.ops`). Importing this module builds and loads
nothing."""

import functools
from pathlib import Path

from .. import prebuilt
from ..cpp import build as cpp_build
from ..onload import OnLoad

__all__ = [
    "CSRC",
    "DEFAULT_INDEX",
    "DEFAULT_LANES",
    "INDEXES",
    "LANES",
    "defines",
    "library_file",
    "sources",
    "load",
    "is_loaded",
    "on_load",
]

CSRC = Path(__file__).parent / "csrc"

#: The prebuilt library :func:`load` loaded, or ``None`` where it built just in time.
prebuilt_path: Path | None = None
#: The registrations on the operators that wait for :func:`load` (:mod:`~.ops` declares
#: them).
on_load = OnLoad()

#: Threads per query the kNN kernels are built for (``lanes``).
LANES = (1, 4, 8, 16, 32)

#: The default, the fastest at the book's sizes on the H200 (chapter 11).
DEFAULT_LANES = 4

#: The kNN operators' indexes: the wide tree over the points in Morton order (chapter
#: 14) and chapter 9's uniform grid (searched with ``lanes`` threads per query).
INDEXES = ("tree", "grid")

#: The default index.
DEFAULT_INDEX = "tree"


def defines() -> list[str]:
    """The constants above as the C++ sources read them (``csrc/fused.h``): the group
    sizes the kernels are built for, as the bits of one number (powers of two up to a
    warp; nvcc would split a list at its commas), and the schemas' defaults."""
    assert all(n & (n - 1) == 0 and 1 <= n <= 32 for n in LANES), LANES
    return [
        f"-DEK_LANES_BITS={sum(1 << (n.bit_length() - 1) for n in LANES)}",
        f"-DEK_DEFAULT_LANES={DEFAULT_LANES}",
        f"-DEK_DEFAULT_INDEX={DEFAULT_INDEX}",
    ]


def sources(cuda: bool) -> list[Path]:
    """The schemas and CPU kernels, and with ``cuda`` the CUDA kernels."""
    files = [CSRC / "fused.cpp", CSRC / "knn_batched.cpp", CSRC / "radius_search.cpp"]
    cuda_files = [
        "grid_build_cuda.cu",
        "knn_batched_cuda.cu",
        "knn_lanes_cuda.cu",
        "radius_cuda.cu",
        "radius_search_cuda.cu",
        "positions_cuda.cu",
        "tree_build_cuda.cu",
        "tree_search_cuda.cu",
    ]
    return files + [CSRC / name for name in cuda_files] if cuda else files


@functools.cache
def load(verbose: bool = False) -> None:
    """Load chapter 9's library, then the prebuilt fused one, or compile (or find in
    the cache) and load it; then make the registrations of :data:`on_load`; once per
    process."""
    global prebuilt_path
    cpp_build.load()
    prebuilt_path = prebuilt.load("fused", [CSRC, cpp_build.CSRC], defines())
    if prebuilt_path is None:
        _build(verbose)
    on_load.run()


def is_loaded() -> bool:
    """Whether :func:`load` has loaded the library in this process."""
    return on_load.loaded


def _build(verbose: bool) -> None:
    from torch.utils import cpp_extension

    with cpp_build.arch_environment() as arch:
        cuda = arch is not None
        cpp_extension.load(
            name="extkernels_fused_cuda" if cuda else "extkernels_fused",
            sources=[str(p) for p in sources(cuda)],
            extra_include_paths=[str(cpp_build.CSRC)],
            extra_cflags=["-O3", *defines()],
            extra_cuda_cflags=["-O3", "-lineinfo", *defines()],
            with_cuda=cuda,
            is_python_module=False,
            verbose=verbose,
        )


def library_file() -> Path:
    """The file of the library :func:`load` loaded (see the C++ backend's
    ``library_file``; on the CPU its kernels call that library's through the
    dispatcher, so a process without this package loads both)."""
    load()
    return prebuilt_path or prebuilt.loaded("extkernels_fused")
