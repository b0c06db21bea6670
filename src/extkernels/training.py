"""One training step of the running example: zero_grad, forward, MSE, backward, Adam
(chapter 1).

The timing protocol (:mod:`~extkernels.timing`) times it, and :mod:`~extkernels.graphs`
captures it in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["make_forward", "make_train_step", "train"]


def make_forward(
    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
) -> Callable[[], torch.Tensor]:
    """A closure doing one forward pass of ``model`` under ``torch.no_grad()``, as the
    timing protocol times it (chapters 1 and 2 profile it).

    Returns:
        ``forward()`` returning the output.
    """

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return model(p_query, p_ref)

    return forward


def make_train_step(
    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    params,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    target: torch.Tensor,
    lr: float = 1e-3,
    capturable: bool = False,
    objective: Callable[[], torch.Tensor] | None = None,
) -> Callable[[], torch.Tensor]:
    """A closure doing one training step: zero_grad, forward, MSE, backward, Adam step.

    ``model`` may be a compiled module; ``params`` are the parameters Adam updates. With
    ``capturable``, Adam keeps its step count on the device, so that the step can be
    captured in a CUDA graph (:mod:`extkernels.graphs`). ``objective`` computes the
    loss instead of the mean squared error of ``model(p_query, p_ref)`` against
    ``target`` (chapter 13: each rank's share of a loss over all ranks).

    Returns:
        ``step()`` returning the (detached) loss.
    """
    params = list(params)
    # On a GPU, Adam's fused implementation (one kernel for all parameters) keeps the
    # optimizer step from dominating the small models of this book; the arithmetic is
    # Adam's either way.
    fused = bool(params) and all(p.is_cuda for p in params)
    optimizer = torch.optim.Adam(
        params, lr=lr, fused=fused or None, capturable=capturable
    )

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        if objective is not None:
            loss = objective()
        else:
            loss = F.mse_loss(model(p_query, p_ref), target)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def train(
    model: torch.nn.Module,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    target: torch.Tensor,
    steps: int,
    lr: float = 1e-3,
) -> list[float]:
    """``steps`` training steps of ``model``, chapter 1's loop as the reader types it
    (the operator chapters train the reader's operator with it).

    Returns:
        the loss before each step.
    """
    step = make_train_step(model, model.parameters(), p_query, p_ref, target, lr=lr)
    return [step().item() for _ in range(steps)]
