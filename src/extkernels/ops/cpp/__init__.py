"""The ``cpp`` backend (chapter 9): an exact kNN search on a uniform grid, and the
aggregation, in C++ (CPU) and CUDA C++ (GPU), registered with ``TORCH_LIBRARY``.

The sources live in ``csrc/`` and are built just in time on first use, never on
import: :func:`load`, which the first call of an operation makes, builds or finds the
library and loads it (:mod:`~.build`), and the fake implementations and the autograd
formula of :mod:`~.ops` are registered right after. The backend is available wherever
a C++ compiler and ninja are installed (and, for CUDA tensors, ``nvcc``); deciding so
builds nothing.
"""

import functools
import shutil

import torch

from ..checks import value_checks_on, values_checked
from ..registry import Backend, Book, register
from . import build
from .ops import load

__all__ = ["BACKEND", "available", "call", "load", "prepare"]

#: :func:`load`, by the name of the registry's hook (``Backend.prepare``).
prepare = load


@functools.cache
def available() -> bool:
    """A C++ compiler and ninja are installed (nothing is built here)."""
    from torch.utils.cpp_extension import is_ninja_available

    compiler = shutil.which("c++") or shutil.which("g++")
    return bool(compiler) and is_ninja_available()


def call(op, *args, switch=None):
    """``op(*args)`` for an operator whose C++ kernels check values themselves: inside
    an entry point, which has just checked them, the kernels' own switch (``switch``,
    by default this library's ``set_value_checks``) is off for the call."""
    if torch.compiler.is_compiling() or values_checked() or not value_checks_on():
        return op(*args)  # the kernels check the values if, and only if, they must
    switch = switch or torch.ops.extkernels_cpp.set_value_checks
    previous = switch(False)
    try:
        return op(*args)
    finally:
        switch(previous)


def _call(name, *args):
    load()
    return call(getattr(torch.ops.extkernels_cpp, name), *args)


def _knn(p_query, p_ref, k):
    return _call("knn", p_query, p_ref, k)


def _knn_aggregate(p_query, p_ref, feats, k, sigma):
    return _call("knn_aggregate_fwd", p_query, p_ref, feats, k, sigma)[0]


def _library():
    return build.library_file()


BACKEND = register(
    Backend(
        "cpp",
        available=available,
        knn=_knn,
        knn_aggregate=_knn_aggregate,
        operators={
            "knn": "extkernels_cpp::knn",
            "knn_aggregate": "extkernels_cpp::knn_aggregate_fwd",
        },
        position_grads=("knn", "knn_aggregate"),
        prepare=load,
        library=_library,
        libraries=("cpp",),
        book=Book(
            chapter=9,
            toolchain="nvcc and a C++ compiler; compiled once per machine",
            variants=lambda v: [
                v.Variant("knn/cpp", "knn", "cpp", chapter=9),
                v.compiled("knn/cpp+compile", "cpp", 9),
                v.compiled("knn/cpp+reduce-overhead", "cpp", 9, mode="reduce-overhead"),
                v.Variant("knn/cpp+graphs", "knn", "cpp", chapter=9, graphs=True),
                # packaged (chapter 15), beside the fused library built just in time
                v.Variant(
                    "knn/cpp+aoti",
                    "knn",
                    "cpp",
                    chapter=15,
                    package=True,
                    after="knn/fused+graphs+jit",
                ),
            ],
            glossary={
                "cpp": "a grid search in CUDA C++, one thread per query (chapter 9)"
            },
            methods={"cpp": {}},
            shipped="knn",
        ),
    )
)
