"""What a captured CUDA graph needs kept alive, beyond PyTorch's tensors (chapter 7).

A CUDA graph replays kernels with the pointers they had at capture. PyTorch keeps the
memory of tensors allocated during capture in the graph's private pool, but objects of
other libraries (a Warp hash grid, its descriptor) are not PyTorch's: a backend that
captures work on such an object hands it to :func:`keep_alive`, and whoever captured the
graph (:class:`extkernels.graphs.CapturedStep`) holds it for as long as the graph lives.
The backend also stops reusing it for other calls: its memory now belongs to the graph.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager

import torch

__all__ = ["capturing", "keep_alive", "owner", "register_hook", "hooks"]

_lock = threading.Lock()
_owners: list[list] = []
_hooks: list[Callable[[], AbstractContextManager]] = []
# Objects captured outside any owner (a graph captured directly with torch.cuda.graph):
# kept for the life of the process, since nothing says when their graph is gone.
_unowned: list = []


def capturing() -> bool:
    """True while PyTorch's current CUDA stream is capturing a graph (False without
    CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def keep_alive(obj: object) -> None:
    """Hold ``obj`` for the graph being captured (called by backends, from any thread:
    the backward of a captured step runs on autograd's device thread)."""
    with _lock:
        (_owners[-1] if _owners else _unowned).append(obj)


@contextmanager
def owner() -> Iterator[list]:
    """Collect what :func:`keep_alive` receives inside the block, in the yielded
    list."""
    kept: list = []
    with _lock:
        _owners.append(kept)
    try:
        yield kept
    finally:
        with _lock:
            _owners.remove(kept)


def register_hook(hook: Callable[[], AbstractContextManager]) -> Callable:
    """Register ``hook``: a context manager that :func:`hooks` enters inside every
    capture made by :class:`extkernels.graphs.CapturedStep` (a backend telling its
    library about the capture). Returns ``hook``, so it can decorate."""
    _hooks.append(hook)
    return hook


@contextmanager
def hooks() -> Iterator[None]:
    """Enter every registered hook (inside ``torch.cuda.graph``, on the capturing
    stream)."""
    with ExitStack() as stack:
        for hook in _hooks:
            stack.enter_context(hook())
        yield
