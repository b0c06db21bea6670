"""The one validation contract of every operator (chapter 1; chapter 3 wires it into
fakes).

The public entry points, every backend's custom operators and every fake implementation
call the same functions here, one per operation (:func:`check_knn`,
:func:`check_knn_aggregate`, :func:`check_radius_aggregate`, and :func:`check_grad_out`
for backward operators). Each raises ``TypeError`` (wrong kind or dtype) or
``ValueError`` (wrong shape, device, layout or value) with a message that starts with
the argument's name and says what was expected.

Checks of tensor *metadata* (dtype, shape, device, layout) are free and always run, also
while ``torch.compile`` traces and inside fake implementations, so a compiled caller
fails at trace time exactly where an eager one fails at run time. The one exception is
the layout inside a fake (:func:`check_contiguous`): strides inside a compiled graph are
the compiler's, and the kernel checks the ones it is given. A backend whose kernels
index a size with 32-bit integers refuses larger ones by :func:`check_index_limit`
(metadata too), with its limit defined beside its kernels. Checks of tensor
*values* (finite coordinates) need the values on the host: a device synchronisation and,
while tracing, a graph break. They therefore run in eager mode only, once per call: both
clouds in one synchronisation, by whoever is called first. An entry point checks, then
calls its backend through :func:`call_checked`, so that the backend's operator does not
check again; an operator called directly checks itself; a compiled caller gets the check
from the operator's real implementation, which runs eagerly inside the compiled graph
(the custom operators of the ``cpp``, ``fused``, ``ptx``, ``warp`` and ``cuml``
backends, and the ``torch`` backend's radius search). Code the compiler traces through
gets no value check when compiled: the ``torch`` backend's brute force and the
``triton`` backend's ``triton_op``, whose bodies Inductor sees. There a non-finite
point gives non-finite distances and arbitrary indices in its rows, as in
``torch.cdist``; check the values before the compiled call where they can be bad.

:func:`value_checks` switches the value checks off for a block of code (``with
value_checks(False): ...``), on the calling thread only: another thread's calls keep
their checks. The timing protocol does so after its warm-up, which ran with them on
(chapter 7 measures what they cost).
"""

from __future__ import annotations

import math
import numbers
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = [
    "check_knn",
    "check_knn_aggregate",
    "check_radius_aggregate",
    "check_grad_out",
    "check_buffer",
    "check_tensor",
    "check_cloud",
    "check_feats",
    "check_int",
    "check_k",
    "check_positive",
    "check_same_device",
    "check_contiguous",
    "check_finite",
    "check_index_limit",
    "call_checked",
    "values_checked",
    "value_checks",
    "on_value_checks",
    "value_checks_on",
    "alert_not_deterministic",
]

T = TypeVar("T")

# Per thread: the reader's switch (``values``, on unless this thread turned it off) and
# how deep the thread is inside call_checked (``depth``).
_local = threading.local()


def _values_on() -> bool:
    return getattr(_local, "values", True)


# Called, on the switching thread, with the new setting whenever value_checks changes
# it: operators that check values in their own language (the C++ backends, whose
# switch is per thread too) keep that thread's switch in step.
_listeners: list[Callable[[bool], object]] = []


def on_value_checks(listener: Callable[[bool], object]) -> None:
    """Call ``listener(enabled)`` now and whenever :func:`value_checks` turns the checks
    on or off, on the thread that does."""
    _listeners.append(listener)
    listener(_values_on())


def _set_values(enabled: bool) -> None:
    _local.values = enabled
    for listener in _listeners:
        listener(enabled)


@contextmanager
def value_checks(enabled: bool) -> Iterator[None]:
    """Turn the checks of tensor values on or off inside a ``with`` block, for every
    backend, on the calling thread only; nested blocks and exceptions restore the
    setting the block found."""
    previous = _values_on()
    _set_values(bool(enabled))
    try:
        yield
    finally:
        _set_values(previous)


def value_checks_on() -> bool:
    """The reader's switch on this thread: whether value checks are on (see
    :func:`value_checks`)."""
    return _values_on()


def values_checked(t: torch.Tensor | None = None) -> bool:
    """True where value checks run: in eager mode, on real tensors, with the checks on,
    and not inside :func:`call_checked` (whose caller has checked the values
    already)."""
    # is_compiling() first: while tracing, the switch is then never read, so a compiled
    # function does not guard on it (turning the checks off, as a CUDA graph's capture
    # does, must not recompile it).
    if torch.compiler.is_compiling() or not _values_on():
        return False
    if getattr(_local, "depth", 0):
        return False
    return t is None or not (is_fake(t) or t.device.type == "meta")


def call_checked(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` with this thread's value checks off: the caller has just
    run them. (While compiling, a plain call: no value check runs at trace time
    anyway.)"""
    if torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        return fn(*args, **kwargs)
    finally:
        _local.depth -= 1


# --------------------------------------------------------- one argument at a time


def check_tensor(name: str, t: object, dtypes: tuple, what: str = "") -> None:
    """A tensor of one of ``dtypes``; ``what`` describes it in the message (``"of
    shape (n, 3)"``)."""
    if not isinstance(t, torch.Tensor):
        kind = f"a torch.Tensor {what}" if what else "a torch.Tensor"
        raise TypeError(f"{name}: expected {kind}, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, got {t.dtype}")


def check_cloud(name: str, points: object, *, dtypes=(torch.float32,)) -> torch.Tensor:
    """Metadata of a point cloud: a contiguous, non-empty ``(n, 3)`` float32 tensor."""
    check_tensor(name, points, dtypes, "of shape (n, 3)")
    if points.dim() != 2 or points.shape[1] != 3:
        raise ValueError(f"{name}: expected shape (n, 3), got {tuple(points.shape)}")
    if points.shape[0] == 0:
        raise ValueError(
            f"{name}: expected at least one point, got an empty cloud of shape (0, 3)"
        )
    check_contiguous(name, points)
    return points


def check_contiguous(name: str, t: torch.Tensor) -> None:
    """A contiguous layout, asked of real tensors only. A fake is not asked: inside a
    compiled graph the strides are the compiler's. Inductor may pad a matmul that feeds
    an operator and show the fake a slice of it; the kernel then gets the layout its
    operator's tag asks for (the eager strides by default, or contiguous ones), and
    checks it itself."""
    if not t.is_contiguous() and not is_fake(t):
        raise ValueError(
            f"{name}: expected a contiguous tensor (call .contiguous() first)"
        )


def check_feats(feats: object, n_ref: int, *, dtypes=(torch.float32,)) -> torch.Tensor:
    """Per-reference-point features: a contiguous ``(n_ref, F)`` float32 tensor, ``F >=
    1``."""
    check_tensor("feats", feats, dtypes, "of shape (n_ref, F)")
    if feats.dim() != 2 or feats.shape[1] == 0:
        raise ValueError(
            f"feats: expected shape (n_ref, F) with F >= 1, got {tuple(feats.shape)}"
        )
    if feats.shape[0] != n_ref:
        raise ValueError(
            f"feats: expected one row per reference point ({n_ref} rows), got "
            f"{feats.shape[0]}"
        )
    check_contiguous("feats", feats)
    return feats


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device; returns it."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name}: expected a tensor on {first.device} like {first_name}, got "
                f"{t.device}"
            )
    return first.device


def check_int(name: str, value: object, expected: str = "an int") -> int | torch.SymInt:
    """An integer argument (not a bool). Traced with a value that changed between calls
    (or ``dynamic=True``), it is a ``SymInt``: the caller's comparisons guard the
    compiled graph and the symbol is returned as it is."""
    integral = isinstance(value, numbers.Integral | torch.SymInt)
    if isinstance(value, bool) or not integral:
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__}")
    return value if isinstance(value, torch.SymInt) else int(value)


def check_k(k: object, n_ref: int) -> int | torch.SymInt:
    """The number of neighbours: an integer in ``[1, n_ref]`` (:func:`check_int`)."""
    k = check_int("k", k)
    if not 1 <= k <= n_ref:
        raise ValueError(f"k: expected 1 <= k <= {n_ref} (the size of p_ref), got {k}")
    return k


def check_positive(name: str, value: object) -> float:
    """A finite, strictly positive real number (``radius``, ``sigma``), by comparisons
    alone: traced with ``dynamic=True``, a global float is symbolic, which
    ``math.isfinite`` cannot take (the comparisons guard the compiled graph instead)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name}: expected a positive float, got {type(value).__name__}"
        )
    if not 0 < value < math.inf:  # NaN fails both
        raise ValueError(f"{name}: expected a finite value > 0, got {value}")
    return float(value)


def check_finite(values: bool | None = None, **clouds: torch.Tensor) -> None:
    """Finite coordinates in every cloud, found with one host synchronisation for all of
    them.

    ``values=None`` checks wherever :func:`values_checked` allows it, ``False`` never,
    ``True`` always (on real tensors)."""
    first = next(iter(clouds.values()))
    if values is None:
        values = values_checked(first)
    if not values:
        return
    finite = torch.stack([torch.isfinite(c).all() for c in clouds.values()])
    if bool(finite.all()):  # the one synchronisation
        return
    for (name, _), ok in zip(clouds.items(), finite.tolist(), strict=True):
        if not ok:
            raise ValueError(
                f"{name}: expected finite coordinates, found NaN or infinity"
            )


def check_index_limit(name: str, what: str, size, limit: int, why: str) -> None:
    """A size that a backend's kernels index with fixed-width integers: ``size`` (a
    count, or a product of counts such as queries × features) at most ``limit``, the
    backend's own constant, defined beside its kernels; ``why`` names the arithmetic
    it protects. Raises ``ValueError`` naming the argument ``name``. Shapes only, so it
    runs in fakes too: under ``torch.compile`` with dynamic shapes ``size`` is a
    ``SymInt``, and the comparison guards the compiled graph on it."""
    if size > limit:
        raise ValueError(f"{name}: expected at most {limit} {what} ({why}), got {size}")


# ---------------------------------------------------------------- one call at a time


def _clouds(p_query: object, p_ref: object) -> None:
    check_cloud("p_query", p_query)
    check_cloud("p_ref", p_ref)
    check_same_device(p_query=p_query, p_ref=p_ref)


def _clouds_and_feats(
    p_query: object, p_ref: object, feats: object, dtypes=(torch.float32,)
) -> None:
    _clouds(p_query, p_ref)
    check_feats(feats, p_ref.shape[0], dtypes=dtypes)
    check_same_device(p_ref=p_ref, feats=feats)


def check_knn(
    p_query: object, p_ref: object, k: object, *, values: bool | None = None
) -> int:
    """The arguments of ``knn``: two clouds on one device, ``1 <= k <= N``. Returns
    ``k``."""
    _clouds(p_query, p_ref)
    k = check_k(k, p_ref.shape[0])
    check_finite(values, p_query=p_query, p_ref=p_ref)
    return k


def check_knn_aggregate(
    p_query: object,
    p_ref: object,
    feats: object,
    k: object,
    sigma: object,
    *,
    values: bool | None = None,
    feats_dtypes: tuple[torch.dtype, ...] = (torch.float32,),
) -> tuple[int, float]:
    """The arguments of ``knn_aggregate`` (``feats_dtypes``: for an operator that takes
    more than float32 features). Returns ``(k, sigma)``."""
    _clouds_and_feats(p_query, p_ref, feats, feats_dtypes)
    k = check_k(k, p_ref.shape[0])
    sigma = check_positive("sigma", sigma)
    check_finite(values, p_query=p_query, p_ref=p_ref)
    return k, sigma


def check_radius_aggregate(
    p_query: object,
    p_ref: object,
    feats: object,
    radius: object,
    sigma: object,
    *,
    values: bool | None = None,
    feats_dtypes: tuple[torch.dtype, ...] = (torch.float32,),
) -> tuple[float, float]:
    """The arguments of ``radius_aggregate`` (``feats_dtypes``: for an operator that
    takes more than float32 features). Returns ``(radius, sigma)``."""
    _clouds_and_feats(p_query, p_ref, feats, feats_dtypes)
    radius = check_positive("radius", radius)
    sigma = check_positive("sigma", sigma)
    check_finite(values, p_query=p_query, p_ref=p_ref)
    return radius, sigma


def check_grad_out(
    grad_out: object, p_query: torch.Tensor, feats: torch.Tensor
) -> torch.Tensor:
    """The incoming gradient of an aggregation's backward operator: a contiguous float32
    ``(M, F)`` tensor on the device of the clouds."""
    want = (p_query.shape[0], feats.shape[1])
    return check_buffer("grad_out", grad_out, want, "M, F", torch.float32, p_query)


def check_buffer(
    name: str,
    t: object,
    shape: tuple,
    what: str,
    dtype: torch.dtype,
    p_query: torch.Tensor,
) -> torch.Tensor:
    """A tensor an operator reads or writes whole (an incoming gradient, an output
    buffer): ``dtype``, ``shape`` (``what`` names its sizes), contiguous, on the device
    of the clouds."""
    check_tensor(name, t, (dtype,))
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{name}: expected shape {tuple(shape)} ({what}), got {tuple(t.shape)}"
        )
    check_contiguous(name, t)
    check_same_device(p_query=p_query, **{name: t})
    return t


# ------------------------------------------------------------------ determinism


def alert_not_deterministic(caller: str) -> None:
    """What PyTorch does for its own kernels without a deterministic implementation,
    for ``caller`` (the operator, and why: atomic additions): under
    ``torch.use_deterministic_algorithms(True)`` a ``RuntimeError`` that names it and
    the flag, with ``warn_only=True`` a ``UserWarning`` instead, and nothing otherwise.
    Called by the CUDA implementations that add with atomics (their sums come out in a
    different order on every run); the C++ ones call ATen's ``alertNotDeterministic``,
    which says the same."""
    if not torch.are_deterministic_algorithms_enabled():
        return
    message = (
        f"{caller} does not have a deterministic implementation, but you set "
        "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just "
        "for this operation, or you can use the 'warn_only=True' option, if that's "
        "acceptable for your application."
    )
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(message, UserWarning, stacklevel=2)
    else:
        raise RuntimeError(message)
