"""The C++ libraries built ahead of time.

``native/`` at the top of the repository is a small package, ``extkernels-native``,
whose ``setup.py`` compiles the C++ backend's library (chapter 9) and the fused one
(chapters 11 and 14) with setuptools into a wheel: ``pip wheel --no-build-isolation
./native``. Where that wheel is installed, :func:`find` hands the backends its
libraries and they load them with ``torch.ops.load_library``, in a fraction of a second;
where it is not, or where it was built from other sources, with other constants, for
another PyTorch or without the CUDA kernels this machine needs, they build just in time
as before, and :func:`find` says why in a warning.

``EXTKERNELS_PREBUILT=0`` in the environment leaves the wheel unused: the benchmark's
``+jit`` variants (chapter 15) time the first call of a process that builds just in
time on a machine where the wheel is installed.

What must match is written into the wheel when it is built (:func:`fingerprint`): a
library compiled against one PyTorch's C++ headers loads only into that PyTorch, and a
library compiled from older sources would run older kernels.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import warnings
from pathlib import Path

import torch

__all__ = ["ENV", "find", "fingerprint", "load", "loaded"]

#: The environment variable that, set to ``0``, leaves the wheel unused.
ENV = "EXTKERNELS_PREBUILT"


def fingerprint(dirs: list[Path], flags: list[str]) -> str:
    """A digest of every file in the source folders ``dirs`` (sources and headers) and
    of the compiler ``flags`` that carry constants into them."""
    digest = hashlib.sha256()
    for folder in dirs:
        for path in sorted(p for p in Path(folder).iterdir() if p.is_file()):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update("\0".join(flags).encode())
    return digest.hexdigest()


def load(name: str, dirs: list[Path], flags: list[str]) -> Path | None:
    """Load the prebuilt library ``name`` with ``torch.ops.load_library`` where
    :func:`find` gives one for this machine (CUDA kernels where a GPU is here); its
    file, or ``None`` where the caller must build just in time."""
    path = find(name, dirs, flags, cuda=torch.cuda.is_available())
    if path is not None:
        torch.ops.load_library(path)
    return path


def loaded(prefix: str) -> Path:
    """The file of the library loaded in this process whose name starts with
    ``prefix`` (``torch.ops.loaded_libraries``: a just-in-time build's, versioned
    ``name_v1.so`` and so on after its sources changed, or a prebuilt one)."""
    found = [
        Path(p) for p in torch.ops.loaded_libraries if Path(p).name.startswith(prefix)
    ]
    if not found:
        raise RuntimeError(f"no library {prefix}* is loaded in this process")
    return found[-1]


def find(name: str, dirs: list[Path], flags: list[str], cuda: bool) -> Path | None:
    """The prebuilt library ``name`` (``"cpp"`` or ``"fused"``) of the installed
    ``extkernels-native`` wheel, when it was built from these sources (``dirs``) and
    ``flags``, for this PyTorch, with CUDA kernels where ``cuda``; ``None`` otherwise,
    with a warning when a wheel is installed but cannot serve; ``None`` without one
    where :data:`ENV` is ``0``."""
    if os.environ.get(ENV) == "0":
        return None
    try:
        native = importlib.import_module("extkernels_native")
    except ImportError:
        return None
    build = native.BUILD
    problems = []
    if build["torch"] != torch.__version__:
        problems.append(f"built for torch {build['torch']}, not {torch.__version__}")
    if cuda and not build["cuda"]:
        problems.append("built without the CUDA kernels this machine uses")
    if build["cuda"] and torch.version.cuda is None:
        problems.append("built with CUDA kernels, which this PyTorch cannot load")
    if build["libraries"][name]["fingerprint"] != fingerprint(dirs, flags):
        problems.append("built from other sources or constants than these")
    if problems:
        warnings.warn(
            f"extkernels-native's {name} library is not used ({'; '.join(problems)}): "
            "building it just in time instead; rebuild the wheel with "
            "`pip wheel --no-build-isolation ./native`",
            stacklevel=3,
        )
        return None
    return native.library(name)
