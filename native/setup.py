"""Builds the C++ backend's and the fused backend's libraries from the sources in
``src/extkernels/ops``: the same files and flags as their just-in-time
builds, taken from those builds' own modules, into ``extkernels_native``."""

import os
import pprint
import shutil
import sys
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import (
    CUDA_HOME,
    BuildExtension,
    CppExtension,
    CUDAExtension,
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from extkernels.ops import prebuilt  # noqa: E402
from extkernels.ops.cpp import build as cpp_build  # noqa: E402
from extkernels.ops.fused import build as fused_build  # noqa: E402

# the CUDA kernels too where nvcc and a CUDA PyTorch are here (EXTKERNELS_NATIVE_CUDA=0:
# the CPU kernels only)
CUDA = (
    CUDA_HOME is not None
    and torch.version.cuda is not None
    and os.environ.get("EXTKERNELS_NATIVE_CUDA", "1") != "0"
)
Extension = CUDAExtension if CUDA else CppExtension

# name -> (sources, folders read by the compiler, constants as flags)
LIBRARIES = {
    "cpp": (cpp_build.sources(CUDA), [cpp_build.CSRC], []),
    "fused": (
        fused_build.sources(CUDA),
        [fused_build.CSRC, cpp_build.CSRC],
        fused_build.defines(),
    ),
}

# setuptools compiles only files below this folder: the source folders are copied in
COPIES = HERE / "csrc"
shutil.rmtree(COPIES, ignore_errors=True)
for folder in {d for _, dirs, _ in LIBRARIES.values() for d in dirs}:
    shutil.copytree(folder, COPIES / folder.parent.name)


def copied(path: Path) -> str:
    return f"csrc/{path.parent.parent.name}/{path.name}"


build = {"torch": torch.__version__, "cuda": CUDA, "libraries": {}}
modules = []
for name, (files, dirs, flags) in LIBRARIES.items():
    build["libraries"][name] = {
        "file": f"_{name}.so",
        "fingerprint": prebuilt.fingerprint(dirs, flags),
    }
    modules.append(
        Extension(
            f"extkernels_native._{name}",
            [copied(f) for f in files],
            include_dirs=[str(COPIES / d.parent.name) for d in dirs],
            extra_compile_args={
                "cxx": ["-O3", *flags],
                "nvcc": ["-O3", "-lineinfo", *flags],
            },
            py_limited_api=True,
        )
    )
(HERE / "extkernels_native" / "_build.py").write_text(
    '"""What the libraries were built for, written by setup.py."""\n\n'
    f"BUILD = {pprint.pformat(build, sort_dicts=False)}\n"
)

setup(
    packages=["extkernels_native"],
    ext_modules=modules,
    cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
