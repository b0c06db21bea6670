"""The ``warp`` backend: radius aggregation over NVIDIA Warp's hash grid (chapters 5-7).

Organised by role:

- :mod:`~.kernels`: the Warp kernels (chapter 5 shows them one by one);
- :mod:`~.ops`: the custom operators, each with its fake and its autograd (chapters
  5-6), and :mod:`~.positions`, the clouds' gradient;
- :mod:`~.grids`: the pool that owns every hash grid, from forward to backward and into
  CUDA graphs (chapters 6-7);
- :mod:`~.saved`: the simple hand-over through ``ctx``, which chapter 6 compares with
  it;
- :mod:`~.interop`: handing tensors and streams to Warp cheaply (chapter 7).

Importing the backend registers it and its operators (``torch.ops.warp.*``) without
importing Warp: Warp is imported, and the kernels compiled (and cached on disk by Warp),
on first use.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from .. import capture
from ..registry import Backend, Book, register
from .grids import POOL
from .interop import registered_capture, warp
from .ops import BACKWARDS
from .positions import radius_aggregate_positions_backward_op  # noqa: F401
from .saved import radius_aggregate_saved_op  # noqa: F401  (registers warp::*_saved)

__all__ = [
    "BACKEND",
    "BACKWARDS",
    "HANDOVERS",
    "available",
    "init",
    "radius_aggregate",
    "grid_cache_size",
    "clear_grid_cache",
]


#: How a forward hands its grid and normalisers to the backward: the backend's pool, or
#: the normalisers saved through ``ctx`` with the grid built again (chapter 6).
HANDOVERS = ("pool", "saved")


def available() -> bool:
    """Warp is installed (it is not imported here)."""
    return importlib.util.find_spec("warp") is not None


def init() -> Any:
    """Import and initialise Warp now (chapters call it in their first cells, so that
    Warp's one-time messages land there); returns the ``warp`` module."""
    return warp()


def grid_cache_size() -> int:
    """Hash grids kept by forwards, waiting for their backward."""
    return POOL.cached()


def clear_grid_cache() -> None:
    """Free every hash grid the backend holds (for example after inference, which leaves
    the forwards' grids behind), spares included."""
    POOL.clear()


def radius_aggregate(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
    *,
    backward: str = "adjoint",
    handover: str = "pool",
) -> torch.Tensor:
    """Radius-bounded aggregation by ``torch.ops.warp.radius_aggregate``; returns ``(M,
    F)``.

    ``backward="manual"`` calls ``torch.ops.warp.radius_aggregate_manual`` instead: the
    same forward, differentiated by the hand-written kernel instead of Warp's adjoint.
    ``handover="saved"`` calls ``torch.ops.warp.radius_aggregate_saved``: the
    normalisers reach the backward through ``ctx`` and the grid is built again (with
    Warp's adjoint).
    """
    if handover not in HANDOVERS:
        raise ValueError(f"handover: expected one of {HANDOVERS}, got {handover!r}")
    if backward not in BACKWARDS:
        raise ValueError(f"backward: expected one of {BACKWARDS}, got {backward!r}")
    if handover == "saved":
        if backward != "adjoint":
            raise ValueError(
                "backward: the 'saved' hand-over differentiates with 'adjoint'"
            )
        return torch.ops.warp.radius_aggregate_saved(
            p_query, p_ref, feats, radius, sigma
        )[0]
    if backward == "adjoint":
        return torch.ops.warp.radius_aggregate(p_query, p_ref, feats, radius, sigma)
    return torch.ops.warp.radius_aggregate_manual(p_query, p_ref, feats, radius, sigma)


# Every capture by extkernels.graphs tells Warp about itself (see
# interop.registered_capture).
capture.register_hook(registered_capture)


def _variants(v) -> list:
    """Its variants of the benchmark (chapters 5 to 7), built with
    :mod:`extkernels.variants` (``v``)."""
    return [
        v.Variant("radius/warp", "radius", "warp", chapter=5),
        v.compiled("radius/warp+compile", "warp", 6),
        v.compiled(
            "radius/warp-manual+compile", "warp", 6, options={"backward": "manual"}
        ),
        v.compiled(
            "radius/warp-saved+compile", "warp", 6, options={"handover": "saved"}
        ),
        v.compiled("radius/warp+reduce-overhead", "warp", 6, mode="reduce-overhead"),
        v.Variant(
            "radius/warp+1thread", "radius", "warp", chapter=7, backward_thread=False
        ),
        v.compiled("radius/warp+compile+1thread", "warp", 7, backward_thread=False),
        v.Variant("radius/warp+graphs", "radius", "warp", chapter=7, graphs=True),
    ]


BACKEND = register(
    Backend(
        "warp",
        available=available,
        radius_aggregate=radius_aggregate,
        operators={"radius_aggregate": "warp::radius_aggregate"},
        position_grads=("radius_aggregate",),
        python_module=__name__,
        book=Book(
            chapter=5,
            toolchain="the warp-lang wheel",
            variants=lambda v: _variants(v),
            glossary={
                "warp": "NVIDIA Warp's hash grid as a custom operator (chapters 5 "
                "to 7)",
                "warp-saved, warp-manual": "Warp's operator handing the normalisers to "
                "its backward through ctx and building the grid again, or with a "
                "backward kernel written by hand instead of Warp's adjoint (chapter 6)",
            },
            advice=lambda g: [
                g.Advice(
                    "Radius neighbourhoods, Warp already in your stack",
                    "Warp's hash grid as a custom operator {registered} (chapters 5 to "
                    "7)",
                    "radius/warp+graphs",
                    "radius_aggregate",
                    lambda e: g.slowest_cloud(e, "warp-radius"),
                )
            ],
            shipped="radius",
        ),
    )
)
