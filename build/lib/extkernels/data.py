"""The running example's data (chapter 1): a Gaussian reference cloud and a query grid.

All tensors are float32 and contiguous; the same seed gives the same cloud on every
device, because the points are drawn on the CPU and then moved.
"""

from __future__ import annotations

import torch

__all__ = ["reference_cloud", "query_grid", "targets", "features"]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def reference_cloud(
    n: int, *, seed: int = 0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``n`` points drawn from a standard 3-D normal.

    Returns:
        p_ref: ``(n, 3)`` float32.
    """
    if n < 1:
        raise ValueError(f"n: expected at least one reference point, got {n}")
    return torch.randn(n, 3, generator=_generator(seed)).to(device)


def query_grid(side: int, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """A regular ``side x side x side`` grid on ``[-1, 1]^3``.

    Returns:
        p_query: ``(side**3, 3)`` float32, x varying slowest.
    """
    if side < 1:
        raise ValueError(
            f"side: expected a positive number of points per axis, got {side}"
        )
    axis = torch.linspace(-1.0, 1.0, side)
    grid = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), dim=-1)
    return grid.reshape(-1, 3).contiguous().to(device)


def targets(
    m: int, *, seed: int = 0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """One random target feature per query point.

    Returns:
        target: ``(m, 1)`` float32, standard normal.
    """
    return torch.randn(m, 1, generator=_generator(seed + 1)).to(device)


def features(
    n: int, f: int, *, seed: int = 0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Random per-point features, for operator tests and examples.

    Returns:
        feats: ``(n, f)`` float32, standard normal.
    """
    return torch.randn(n, f, generator=_generator(seed + 2)).to(device)
