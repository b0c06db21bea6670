"""One public entry point per operation, many backends behind it.

A backend registers an implementation of an operation under a name (``torch``, ``cuml``,
``warp``, ...), the devices it runs on and a test of whether it can run on this machine. The
public functions in :mod:`extkernels.ops` check their inputs once and dispatch here, so a new
chapter adds a backend without touching callers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Backend", "register", "backends", "lookup"]

OPERATIONS = ("knn", "knn_aggregate", "radius_aggregate")


@dataclass(frozen=True)
class Backend:
    """One implementation of one operation."""

    op: str
    name: str
    fn: Callable
    devices: tuple[str, ...]
    available: Callable[[], bool]

    def runs_here(self) -> bool:
        """True when its library is importable and one of its devices exists on this machine."""
        has_device = any(
            d == "cpu" or (d == "cuda" and torch.cuda.is_available()) for d in self.devices
        )
        return has_device and self.available()


_REGISTRY: dict[str, dict[str, Backend]] = {op: {} for op in OPERATIONS}


def register(
    op: str,
    name: str,
    *,
    devices: tuple[str, ...] = ("cpu", "cuda"),
    available: Callable[[], bool] = lambda: True,
) -> Callable[[Callable], Callable]:
    """Decorator: make ``fn`` the ``name`` backend of operation ``op``."""
    if op not in _REGISTRY:
        raise ValueError(f"op: expected one of {OPERATIONS}, got {op!r}")

    def decorate(fn: Callable) -> Callable:
        _REGISTRY[op][name] = Backend(op, name, fn, tuple(devices), available)
        return fn

    return decorate


def backends(op_name: str) -> list[str]:
    """Names of the backends of ``op_name`` that can run on this machine."""
    if op_name not in _REGISTRY:
        raise ValueError(f"op_name: expected one of {OPERATIONS}, got {op_name!r}")
    return [name for name, b in _REGISTRY[op_name].items() if b.runs_here()]


def lookup(op: str, name: str, device: torch.device) -> Backend:
    """The backend ``name`` of ``op``, checked against the device of its inputs."""
    table = _REGISTRY[op]
    if name not in table:
        raise ValueError(f"backend: expected one of {sorted(table)} for {op}, got {name!r}")
    b = table[name]
    if device.type not in b.devices:
        raise ValueError(
            f"backend: {name!r} runs on {' or '.join(b.devices)} tensors, got tensors on {device}"
        )
    if not torch.compiler.is_compiling() and not b.available():
        raise RuntimeError(f"backend: {name!r} is not available on this machine (is it installed?)")
    return b
