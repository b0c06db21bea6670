"""A whole forward pass or training step in one CUDA graph (chapter 7).

The projector's step is short enough that the host sets its pace: every kernel costs
microseconds of Python, PyTorch and Warp launch code, often more than the GPU spends on
it. A CUDA graph records the kernels of one call once and replays them with one launch.
Everything still runs at every replay: the MLPs, the hash grid's build over the current
points, the aggregation, and for a training step the loss, the backward and Adam's
update; only the host's work is gone.

Capture has rules, which :class:`CapturedStep` follows:

- Warm up first, eagerly, on the capture stream: it compiles kernels, fills the caches
  and validates the inputs' values (value checks need the host, so they are off during
  capture).
- Static inputs: a replay reads the tensors the capture saw. To run on new data, copy it
  into them (``p_ref.copy_(new_points)``); shapes cannot change.
- The result is static too: each replay overwrites the tensor the capture returned.
- A training step needs an optimizer that keeps its state on the device
  (``capturable=True``), and gradients set to ``None`` before capture, so that the
  backward allocates them in the graph's memory
  (:func:`~extkernels.training.make_train_step` does both).

The Warp operators support capture (see :mod:`extkernels.ops.warp.grids`); cuML's search
synchronises with the host and cannot be captured. :data:`IN_ONE_GRAPH` holds
inductor's settings for a compiled projector inside one graph (chapter 11).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .ops import capture
from .ops.checks import value_checks
from .training import make_forward, make_train_step

__all__ = ["IN_ONE_GRAPH", "CapturedStep", "captured_forward", "captured_train_step"]

#: Inductor's settings for the compiled projector inside one CUDA graph (chapter 11).
#: Its pattern matcher rewrites each ``Linear`` followed by pointwise work into a
#: matrix product without bias and a kernel that adds the bias (so that it fuses with
#: the ReLU); for the projector's 25-wide layers the bias costs less inside cuBLAS's
#: product. ``knn/fused+compile+graphs+inductor-defaults`` times the default beside it.
IN_ONE_GRAPH = {"pattern_matcher": False}


class CapturedStep:
    """``fn`` captured in one CUDA graph; calling the object replays it.

    Args:
        fn: a function of no arguments launching CUDA work (PyTorch operations, Warp
            launches on PyTorch's current stream), on tensors that stay the same between
            calls.
        warmup: eager calls before capture, on the capture stream.

    Calling returns what ``fn`` returned during capture, rewritten by the replay. The
    graph runs on PyTorch's current stream; nothing waits for it.
    """

    def __init__(self, fn: Callable[[], object], *, warmup: int = 3):
        if warmup < 1:
            raise ValueError(
                f"warmup: expected at least 1 eager call before capture, got {warmup}"
            )
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CapturedStep: CUDA graphs need a CUDA device, and none is here"
            )
        # A stream of its own: the warm-up and the capture share it, and so do the
        # objects that backends keep per stream (the Warp operators' spare grids).
        self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        self.graph = torch.cuda.CUDAGraph()
        # `kept`: what backends captured outside PyTorch's memory (Warp grids), alive as
        # long as the graph.
        with capture.owner() as self.kept, value_checks(False):
            with torch.cuda.graph(self.graph, stream=self.stream), capture.hooks():
                self.result = fn()

    def __call__(self) -> object:
        self.graph.replay()
        return self.result


def captured_forward(
    model: torch.nn.Module,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    *,
    warmup: int = 3,
) -> CapturedStep:
    """The projector's forward pass under ``torch.no_grad()``, captured; returns ``(M,
    1)``."""

    return CapturedStep(make_forward(model, p_query, p_ref), warmup=warmup)


def captured_train_step(
    model: torch.nn.Module,
    params,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    target: torch.Tensor,
    *,
    lr: float = 1e-3,
    warmup: int = 3,
) -> CapturedStep:
    """One training step (zero_grad, forward, MSE, backward, Adam) captured; calling it
    trains the model by one step and returns the loss of that step."""
    step = make_train_step(
        model, params, p_query, p_ref, target, lr=lr, capturable=True
    )
    return CapturedStep(step, warmup=warmup)
