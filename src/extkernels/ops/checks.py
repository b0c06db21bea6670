"""Input checks shared by every operator and backend.

Each check raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape, device,
layout or value) with a message that names the argument and says what was expected.

Checks on tensor *metadata* (dtype, shape, device, layout) are free and always run, also while
``torch.compile`` traces. Checks on tensor *values* (finite coordinates) need the values on the
host, which is a device synchronisation and, while tracing, a graph break; they therefore run
in eager mode only. Compiled callers get them from the operators' own eager implementations.

Because they synchronise, value checks can be switched off for a block of code with
:func:`value_checks` (``with value_checks(False): ...``); the timing protocol does so after its
warm-up, which ran with them on (chapter 7 measures what they cost).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = [
    "check_cloud",
    "check_feats",
    "check_k",
    "check_positive",
    "check_same_device",
    "values_checked",
    "value_checks",
]

_enabled = {"values": True}


@contextmanager
def value_checks(enabled: bool) -> Iterator[None]:
    """Turn the checks of tensor values on or off inside a ``with`` block (for every backend)."""
    previous = _enabled["values"]
    _enabled["values"] = bool(enabled)
    try:
        yield
    finally:
        _enabled["values"] = previous


def values_checked(t: torch.Tensor | None = None) -> bool:
    """True where value checks can run: in eager mode on real tensors, not while
    ``torch.compile`` traces and not on the fake tensors of a fake implementation."""
    if not _enabled["values"] or torch.compiler.is_compiling():
        return False
    return t is None or not (is_fake(t) or t.device.type == "meta")


def check_cloud(
    name: str, points: object, *, dtypes=(torch.float32,), values: bool | None = None
) -> torch.Tensor:
    """A point cloud: a contiguous, non-empty ``(n, 3)`` tensor of finite float32 coordinates.

    ``values=False`` checks the metadata only (a caller whose inputs were checked already);
    the default checks the values wherever :func:`values_checked` allows it.
    """
    if not isinstance(points, torch.Tensor):
        raise TypeError(
            f"{name}: expected a torch.Tensor of shape (n, 3), got {type(points).__name__}"
        )
    if points.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, got {points.dtype}")
    if points.dim() != 2 or points.shape[1] != 3:
        raise ValueError(f"{name}: expected shape (n, 3), got {tuple(points.shape)}")
    if points.shape[0] == 0:
        raise ValueError(f"{name}: expected at least one point, got an empty cloud of shape (0, 3)")
    if not points.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (call .contiguous() first)")
    if values is None:
        values = values_checked(points)
    if values and not bool(torch.isfinite(points).all()):
        raise ValueError(f"{name}: expected finite coordinates, found NaN or infinity")
    return points


def check_feats(feats: object, n_ref: int, *, dtypes=(torch.float32,)) -> torch.Tensor:
    """Per-reference-point features: a contiguous ``(n_ref, F)`` float32 tensor, ``F >= 1``."""
    if not isinstance(feats, torch.Tensor):
        raise TypeError(
            f"feats: expected a torch.Tensor of shape (n_ref, F), got {type(feats).__name__}"
        )
    if feats.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"feats: expected dtype {want}, got {feats.dtype}")
    if feats.dim() != 2 or feats.shape[1] == 0:
        raise ValueError(f"feats: expected shape (n_ref, F) with F >= 1, got {tuple(feats.shape)}")
    if feats.shape[0] != n_ref:
        raise ValueError(
            f"feats: expected one row per reference point ({n_ref} rows), got {feats.shape[0]}"
        )
    if not feats.is_contiguous():
        raise ValueError("feats: expected a contiguous tensor (call .contiguous() first)")
    return feats


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device; returns it."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name}: expected a tensor on {first.device} like {first_name}, got {t.device}"
            )
    return first.device


def check_k(k: object, n_ref: int) -> int:
    """The number of neighbours: an integer in ``[1, n_ref]``."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"k: expected an int, got {type(k).__name__}")
    if not 1 <= k <= n_ref:
        raise ValueError(f"k: expected 1 <= k <= {n_ref} (the size of p_ref), got {k}")
    return int(k)


def check_positive(name: str, value: object) -> float:
    """A finite, strictly positive real number (``radius``, ``sigma``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a positive float, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected a finite value > 0, got {value}")
    return float(value)
