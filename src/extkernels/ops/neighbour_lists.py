"""The contract of the neighbour lists that graph layers take: the radius search and
its padded form (the radius of chapter 5 as a list of neighbours, compiled as chapter 2
compiles), and the helpers that turn lists into edges.

:func:`check_radius_search` is what the entry point, the custom operators and their
fakes all call, by the rules of :mod:`~extkernels.ops.checks`: metadata always,
values (finite coordinates, the offsets' values) in eager mode only. Unlike the
projector's operations, a radius search takes an empty cloud of either kind (a query
with nothing around it finds no neighbour, and neither does any query of an empty
reference cloud), and float64 clouds as well as float32 ones (the same dtype for both).
Batches are :mod:`~extkernels.ops.batches`' packed clouds: the queries of cloud ``b``
search cloud ``b`` only.
"""

from __future__ import annotations

import torch

from .batches import check_call
from .checks import (
    check_cloud,
    check_finite,
    check_int,
    check_positive,
    values_checked,
)

__all__ = [
    "DTYPES",
    "check_points",
    "check_radius_search",
    "check_max_neighbours",
    "fake_csr",
    "fake_padded",
]

#: The dtypes of the clouds a radius search takes.
DTYPES = (torch.float32, torch.float64)


def check_points(name: str, points: object, dtypes=DTYPES) -> torch.Tensor:
    """:func:`~extkernels.ops.checks.check_cloud`'s contract, an empty ``(0, 3)``
    cloud allowed."""
    if not (
        isinstance(points, torch.Tensor)
        and tuple(points.shape) == (0, 3)
        and points.dtype in dtypes
    ):
        check_cloud(name, points, dtypes=dtypes)
    return points


def check_max_neighbours(max_neighbours: object) -> int | None:
    """``None`` (every neighbour) or an int >= 1 (:func:`~.checks.check_int`)."""
    if max_neighbours is None:
        return None
    max_neighbours = check_int("max_neighbours", max_neighbours, "an int or None")
    if max_neighbours < 1:
        raise ValueError(f"max_neighbours: expected an int >= 1, got {max_neighbours}")
    return max_neighbours


def check_radius_search(
    p_query: object,
    p_ref: object,
    radius: object,
    max_neighbours: object = None,
    query_offsets: object = None,
    ref_offsets: object = None,
    *,
    values: bool | None = None,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
) -> tuple[float, int | None]:
    """The arguments of ``radius_search``: two clouds (possibly empty) of one dtype on
    one device, a finite ``radius > 0``, ``max_neighbours`` ``None`` or >= 1, and both
    offsets or neither. Returns ``(radius, max_neighbours)``."""
    check_points("p_query", p_query, dtypes)
    check_points("p_ref", p_ref, dtypes)
    if p_ref.dtype != p_query.dtype:
        raise TypeError(
            f"p_ref: expected dtype {p_query.dtype} like p_query, got {p_ref.dtype}"
        )
    if p_ref.device != p_query.device:
        raise ValueError(
            f"p_ref: expected a tensor on {p_query.device} like p_query, got "
            f"{p_ref.device}"
        )
    radius = check_positive("radius", radius)
    max_neighbours = check_max_neighbours(max_neighbours)
    if values is None:
        values = values_checked(p_query)
    check_call(query_offsets, ref_offsets, p_query, p_ref, values=values)
    check_finite(values, p_query=p_query, p_ref=p_ref)
    return radius, max_neighbours


def fake_csr(p_query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A CSR radius search's outputs for a fake, as its operators order them:
    ``distances (E,)``, ``offsets (M + 1,)``, ``indices (E,)``. ``E`` is known once the
    search ran: an unbacked size (``new_dynamic_size()``)."""
    edges = torch.library.get_ctx().new_dynamic_size()
    return (
        p_query.new_empty(edges),
        p_query.new_empty(p_query.shape[0] + 1, dtype=torch.int64),
        p_query.new_empty(edges, dtype=torch.int64),
    )


def fake_padded(
    p_query: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A padded radius search's outputs for a fake: ``distances (M, K)``, ``indices
    (M, K)``, ``counts (M,)``."""
    m = p_query.shape[0]
    return (
        p_query.new_empty(m, k),
        p_query.new_empty(m, k, dtype=torch.int64),
        p_query.new_empty(m, dtype=torch.int64),
    )
