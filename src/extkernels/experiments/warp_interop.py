"""Warp and PyTorch, fast: the small experiments of chapter 7.

Each function isolates one interop cost: how a tensor is handed to a Warp kernel
(:func:`launch_saxpy`), PyTorch's deferred gradient allocation (:class:`SquaresNaive`
against :class:`SquaresFixed`) and whether Warp shares PyTorch's stream
(:func:`saxpy_chain`); chapter 7 captures them in CUDA graphs with
:class:`extkernels.graphs.CapturedStep`. The warp backend applies the fast choice of
each, through the helpers of :mod:`extkernels.ops.warp.interop`.

The ``*_numbers`` functions pick the numbers chapter 7's prose quotes from its tables,
by glue key, as plain Python numbers.
"""

import functools
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pandas as pd
import torch

from ..ops.warp.interop import launch, warp, where

__all__ = [
    "METHODS",
    "launch_saxpy",
    "SquaresNaive",
    "SquaresFixed",
    "squares_step",
    "saxpy_chain",
    "chain_step",
    "synchronising_calls",
    "replay_matches",
    "launch_numbers",
    "deferred_numbers",
    "graph_numbers",
]

#: Ways of handing a tensor to a kernel: three ways of calling ``wp.launch``, and
#: replaying a launch command recorded once (``wp.launch(..., record_cmd=True)``) with
#: new descriptors.
METHODS = (
    "from_torch",
    "from_torch(return_ctype=True)",
    "tensor directly",
    "recorded launch",
)


@functools.cache
def _kernels() -> Any:
    wp = warp()

    @wp.kernel
    def saxpy(x: wp.array(dtype=float), y: wp.array(dtype=float), a: float):
        i = wp.tid()
        y[i] = a * x[i] + y[i]

    @wp.kernel(enable_backward=False)
    def squares(
        a: wp.array(dtype=float), b: wp.array(dtype=float), out: wp.array(dtype=float)
    ):
        i = wp.tid()
        out[i] = a[i] * a[i] + b[i] * b[i]

    @wp.kernel(enable_backward=False)
    def squares_grad(
        grad_out: wp.array(dtype=float),
        a: wp.array(dtype=float),
        b: wp.array(dtype=float),
        grad_a: wp.array(dtype=float),
        grad_b: wp.array(dtype=float),
    ):
        i = wp.tid()
        grad_a[i] = 2.0 * a[i] * grad_out[i]
        grad_b[i] = 2.0 * b[i] * grad_out[i]

    return saxpy, squares, squares_grad


def _stream(t: torch.Tensor):
    """Warp on PyTorch's current stream (CUDA), or nothing to do (CPU). The Warp wrapper
    of the stream is the operators' kept one
    (:func:`~extkernels.ops.warp.interop.where`): a wrapper made and dropped per call
    would register and release the stream with Warp every time."""
    if t.is_cuda:
        return warp().ScopedStream(where(t.device).stream, sync_enter=False)
    return nullcontext()


def launch_saxpy(x: torch.Tensor, y: torch.Tensor, a: float, method: str) -> None:
    """``y += a * x`` by a Warp kernel, handing the tensors over one of :data:`METHODS`.

    Args:
        x, y: ``(n,)`` float32 on one device; ``y`` is updated in place.
    """
    wp = warp()
    saxpy, _, _ = _kernels()
    if method == "from_torch":
        args = [wp.from_torch(x), wp.from_torch(y)]
    elif method == "from_torch(return_ctype=True)":
        args = [
            wp.from_torch(x, return_ctype=True),
            wp.from_torch(y, return_ctype=True),
        ]
    elif method == "tensor directly":
        args = [x, y]
    elif method == "recorded launch":
        # What the book's operators do (see extkernels.ops.warp.interop.launch): record
        # the launch on the first call, then overwrite its parameters with the new
        # descriptors and replay it.
        args = [
            wp.from_torch(x, return_ctype=True),
            wp.from_torch(y, return_ctype=True),
            a,
        ]
        launch(saxpy, (x.shape[0],), args, where(x.device))
        return
    else:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    with _stream(x):
        wp.launch(
            saxpy,
            dim=x.shape[0],
            inputs=[*args, a],
            device=wp.device_from_torch(x.device),
        )


def _squares(a: torch.Tensor, b: torch.Tensor, convert: Callable) -> torch.Tensor:
    wp = warp()
    _, squares, _ = _kernels()
    out = torch.empty_like(a)
    with _stream(a):
        wp.launch(
            squares,
            dim=a.shape[0],
            inputs=[convert(a), convert(b), convert(out)],
            device=wp.device_from_torch(a.device),
        )
    return out


def _squares_grad(grad_out, a, b, convert: Callable):
    wp = warp()
    _, _, squares_grad = _kernels()
    grad_a, grad_b = torch.empty_like(a), torch.empty_like(b)
    with _stream(a):
        wp.launch(
            squares_grad,
            dim=a.shape[0],
            inputs=[
                convert(grad_out.contiguous()),
                convert(a),
                convert(b),
                convert(grad_a),
                convert(grad_b),
            ],
            device=wp.device_from_torch(a.device),
        )
    return grad_a, grad_b


class SquaresNaive(torch.autograd.Function):
    """``a**2 + b**2`` by Warp, converting with plain ``wp.from_torch``.

    ``a`` and ``b`` require gradients, so ``wp.from_torch`` allocates their ``.grad`` in
    the forward pass, behind autograd's back; autograd later finds gradients it did not
    allocate and synchronises the device before accumulating into them.
    """

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _squares(a, b, warp().from_torch)

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        return _squares_grad(grad_out, a, b, warp().from_torch)


def _plain(t: torch.Tensor):
    return warp().from_torch(t, requires_grad=False, return_ctype=True)


class SquaresFixed(SquaresNaive):
    """The same function, converting with ``requires_grad=False`` (and
    ``return_ctype=True``): Warp never touches ``.grad``, autograd allocates the
    gradients itself."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _squares(a, b, _plain)

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        return _squares_grad(grad_out, a, b, _plain)


def squares_step(
    fn: type[torch.autograd.Function], a: torch.Tensor, b: torch.Tensor
) -> Callable[[], None]:
    """A closure: fresh leaf copies of ``a`` and ``b`` (no ``.grad`` yet), forward,
    backward."""

    def step() -> None:
        a_ = a.detach().clone().requires_grad_(True)
        b_ = b.detach().clone().requires_grad_(True)
        fn.apply(a_, b_).sum().backward()

    return step


def saxpy_chain(
    x: torch.Tensor, y: torch.Tensor, n_links: int, *, shared: bool
) -> torch.Tensor:
    """Alternate ``n_links`` PyTorch ops and Warp launches on ``y``; returns ``y``.

    With ``shared=True`` Warp launches on PyTorch's current stream and nothing waits.
    With ``shared=False`` Warp uses its own stream, so every hand-over must synchronise:
    PyTorch's stream before Warp reads, Warp's stream before PyTorch reads.
    """
    wp = warp()
    saxpy, _, _ = _kernels()
    device = wp.device_from_torch(x.device)
    xs, ys = _plain(x), _plain(y)
    for _ in range(n_links):
        y.mul_(0.5)
        if shared or not x.is_cuda:
            with _stream(x):
                wp.launch(saxpy, dim=x.shape[0], inputs=[xs, ys, 1.0], device=device)
        else:
            torch.cuda.current_stream(x.device).synchronize()
            wp.launch(saxpy, dim=x.shape[0], inputs=[xs, ys, 1.0], device=device)
            wp.synchronize_stream(wp.get_stream(device))
    return y


def chain_step(x: torch.Tensor, y: torch.Tensor, n_links: int) -> Callable[[], None]:
    """A closure for a CUDA graph (chapter 7): zero ``y``, then :func:`saxpy_chain` on
    PyTorch's stream, in place; every call leaves ``y`` the same.

    Args:
        x, y: ``(n,)`` float32 on one device, the same tensors at every call.
    """

    def step() -> None:
        y.zero_()
        saxpy_chain(x, y, n_links, shared=True)

    return step


def synchronising_calls(fn: Callable[[], object]) -> int:
    """How many synchronising operations PyTorch reports while ``fn`` runs once (its
    synchronisation debug mode, which warns on each); 0 on the CPU."""
    if not torch.cuda.is_available():
        return 0
    import warnings

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def replay_matches(
    replay: Callable[[], torch.Tensor],
    model: torch.nn.Module,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    atol: float = 1e-6,
) -> bool:
    """Whether a captured forward pass, replayed, gives what ``model`` gives eagerly on
    the graph's inputs as they are now (chapter 7).

    Args:
        replay: replays the captured forward (from
            :func:`extkernels.graphs.captured_forward`), returning ``(M, 1)``.
        model: the projector it captured, run eagerly under ``torch.no_grad()``.
        p_query, p_ref: the graph's input tensors, ``(M, 3)`` and ``(N, 3)`` float32.
    """
    replayed = replay()
    with torch.no_grad():
        eager = model(p_query, p_ref)
    return torch.allclose(replayed, eager, atol=atol)


# ---------------------------------------------------------------- numbers for the prose


def launch_numbers(cost: pd.Series) -> dict[str, float]:
    """Chapter 7's gains from the cost per launch of each of :data:`METHODS`:
    ``return_ctype=True`` over a full ``wp.from_torch`` (``ctype_gain``), and a recorded
    launch over ``return_ctype=True`` descriptors (``record_gain``)."""
    ctype = cost["from_torch(return_ctype=True)"]
    return {
        "ctype_gain": float(cost["from_torch"] / ctype),
        "record_gain": float(ctype / cost["recorded launch"]),
    }


def deferred_numbers(deferred: pd.DataFrame) -> dict[str, float]:
    """Chapter 7's number from its table of :class:`SquaresNaive` and
    :class:`SquaresFixed` (rows by class name): the naive step's time over the fixed
    one's (``deferred_gain``)."""
    ms = deferred["ms per step"]
    return {"deferred_gain": float(ms["SquaresNaive"] / ms["SquaresFixed"])}


def graph_numbers(table: pd.DataFrame) -> dict[str, float]:
    """Chapter 7's number for the projector in one CUDA graph, from a timing table
    with ``radius/warp`` and ``radius/warp+graphs``: the graphs' gain over eager in the
    training step (``g_train_gain``)."""
    train = table["train_ms"]
    return {"g_train_gain": float(train["radius/warp"] / train["radius/warp+graphs"])}
