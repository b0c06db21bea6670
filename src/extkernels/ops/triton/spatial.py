"""Spatial order for the pruned search (chapter 8): Morton codes, tile boxes and each
query tile's first reference tile, all computed on the device with no host
synchronisation."""

import torch

__all__ = ["morton_codes", "Plan", "plan"]

BITS = 10  # per axis: 30-bit codes, 1024 cells per axis


def morton_codes(
    points: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> torch.Tensor:
    """The Morton (Z-order) code of each point in the box ``lo .. hi``: points close in
    space get close codes. Points outside the box are clamped to it."""
    span = (hi - lo).clamp_min(torch.finfo(points.dtype).tiny)
    cells = ((points - lo) / span * (2**BITS - 1)).round().clamp(0, 2**BITS - 1).long()
    code = torch.zeros(points.shape[0], dtype=torch.int64, device=points.device)
    for bit in range(BITS):
        for axis in range(3):
            code |= ((cells[:, axis] >> bit) & 1) << (3 * bit + axis)
    return code


class Plan:
    """What the pruned kernels need: both clouds in Morton order and how to undo it,
    the reference tiles' boxes, and each query tile's first reference tile."""

    def __init__(self, query, ref, query_order, ref_order, lo, hi, start):
        self.query, self.ref = query, ref
        self.query_order, self.ref_order = query_order, ref_order
        self.lo, self.hi, self.start = lo, hi, start


def plan(
    p_query: torch.Tensor, p_ref: torch.Tensor, block_q: int, block_r: int
) -> Plan:
    lo, hi = p_ref.amin(dim=0), p_ref.amax(dim=0)
    ref_codes, ref_order = morton_codes(p_ref, lo, hi).sort()
    query_codes, query_order = morton_codes(p_query, lo, hi).sort()
    ref = p_ref[ref_order].contiguous()
    n, tiles = ref.shape[0], -(-p_ref.shape[0] // block_r)
    # Pad the last tile with its own last point, so that its box holds real points.
    padded = torch.cat([ref, ref[-1:].expand(tiles * block_r - n, 3)])
    boxes = padded.view(tiles, block_r, 3)
    # A query tile starts at the reference tile where its first query's code falls.
    first = query_codes[::block_q].contiguous()
    start = (torch.searchsorted(ref_codes, first) // block_r).clamp(max=tiles - 1)
    return Plan(
        p_query[query_order].contiguous(),
        ref,
        query_order,
        ref_order,
        boxes.amin(dim=1).contiguous(),
        boxes.amax(dim=1).contiguous(),
        start.to(torch.int32).contiguous(),
    )
