"""Helpers for the first cells of every chapter (chapter 1 onward): versions, hardware
(:func:`~extkernels.provenance.versions`, kept here under its chapters' name) and
showing package code."""

from __future__ import annotations

import inspect
from pathlib import Path

from .provenance import versions

__all__ = ["versions", "show_source", "cpp_excerpt", "show_cpp", "fake_tensors"]


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
