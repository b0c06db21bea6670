"""Batches of clouds of different sizes, for the batched operators (chapter 16): the
clouds concatenated along the point axis, cloud ``b``'s points at rows
``offsets[b]:offsets[b + 1]`` of an ``(N, 3)`` tensor, with ``offsets`` an int64
``(B + 1,)`` tensor starting at 0 and ending at ``N``. It is PyTorch Geometric's layout
with the ``batch`` vector replaced by its offsets, so a kernel finds a cloud's points
without a search.

The converters take the two layouts the libraries use: PyTorch3D's padded ``(B, P, 3)``
tensors with ``lengths`` (:func:`pack_padded`, and back with :func:`pad_packed`) and
PyG's sorted ``batch`` vector (:func:`offsets_from_batch`). :func:`check_offsets` and
:func:`check_batch` are the checks every batched entry point runs: the dtype, shape and
number of clouds always (metadata, free while tracing), the values (starting at 0, never
decreasing, ending at the number of points) in eager mode, as the finite-coordinates
check does (:mod:`~extkernels.ops.checks`).

The entry points check a call's offsets with :func:`check_call` and, for a backend that
does not take a batch itself (``Backend.batched``), run its single-cloud implementation
once per cloud through :func:`per_cloud`; :func:`cloud_of` gives each point its cloud
by tensor operations, for a backend that does (the torch brute force masks with it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = [
    "offsets_from_lengths",
    "offsets_from_batch",
    "pack_padded",
    "pad_packed",
    "check_offsets",
    "check_batch",
    "check_clouds_hold",
    "check_call",
    "cloud_of",
    "per_cloud",
]


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """``(B + 1,)`` int64 offsets of clouds of ``lengths`` points each (``(B,)``)."""
    if lengths.dim() != 1:
        raise ValueError(
            f"lengths: expected a 1-D tensor, got shape {tuple(lengths.shape)}"
        )
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise TypeError(f"lengths: expected an integer tensor, got {lengths.dtype}")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError("lengths: expected no negative length")
    zero = lengths.new_zeros(1, dtype=torch.int64)
    return torch.cat([zero, lengths.to(torch.int64).cumsum(0)])


def offsets_from_batch(
    batch: torch.Tensor, num_clouds: int | None = None
) -> torch.Tensor:
    """Offsets from PyG's ``batch`` vector (``(N,)``, cloud of each point, sorted):
    ``num_clouds`` clouds (default: the largest index plus one; trailing empty clouds
    need it given)."""
    if batch.dim() != 1 or batch.dtype != torch.int64:
        raise TypeError(
            f"batch: expected a 1-D int64 tensor, got {batch.dtype} of shape "
            f"{tuple(batch.shape)}"
        )
    if batch.numel() > 1 and bool((batch[1:] < batch[:-1]).any()):
        raise ValueError("batch: expected the points sorted by cloud (non-decreasing)")
    if batch.numel() and int(batch[0]) < 0:
        raise ValueError("batch: expected cloud indices >= 0")
    largest = int(batch[-1]) + 1 if batch.numel() else 0
    n = largest if num_clouds is None else num_clouds
    if n < largest:
        raise ValueError(f"num_clouds: expected at least {largest}, got {n}")
    return offsets_from_lengths(torch.bincount(batch, minlength=n))


def pack_padded(
    points: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch3D's padded ``(B, P, D)`` clouds with ``lengths`` ``(B,)`` as the packed
    ``(sum(lengths), D)`` points and their offsets."""
    if points.dim() != 3:
        raise ValueError(f"points: expected (B, P, D), got shape {tuple(points.shape)}")
    if lengths.shape != points.shape[:1]:
        raise ValueError(
            f"lengths: expected shape ({points.shape[0]},), one per cloud, got "
            f"{tuple(lengths.shape)}"
        )
    offsets = offsets_from_lengths(lengths)
    if lengths.numel() and int(lengths.max()) > points.shape[1]:
        raise ValueError(
            f"lengths: expected at most {points.shape[1]} points per cloud (the "
            f"padded size), got {int(lengths.max())}"
        )
    keep = torch.arange(points.shape[1], device=points.device) < lengths[:, None]
    return points[keep].contiguous(), offsets


def pad_packed(
    points: torch.Tensor, offsets: torch.Tensor, fill: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_padded`: ``(B, P, D)`` clouds padded with ``fill`` to
    the largest cloud, and their ``lengths``."""
    check_offsets("offsets", offsets, points.shape[0])
    lengths = offsets.diff()
    b, p = lengths.numel(), int(lengths.max()) if lengths.numel() else 0
    out = points.new_full((b, p, *points.shape[1:]), fill)
    keep = torch.arange(p, device=points.device) < lengths[:, None]
    out[keep] = points
    return out, lengths


def check_offsets(
    name: str,
    offsets: object,
    n_points: int,
    *,
    values: bool = True,
    device: torch.device | None = None,
) -> int:
    """That ``offsets`` are the offsets of clouds packed into ``n_points`` points (on
    ``device``, p_query's, where given); returns the number of clouds. The values are
    checked where ``values`` is true and the tensor is real (not while tracing), after
    the metadata."""
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(
            f"{name}: expected a torch.Tensor, got {type(offsets).__name__}"
        )
    if offsets.dtype != torch.int64:
        raise TypeError(f"{name}: expected int64 offsets, got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.shape[0] < 1:
        raise ValueError(
            f"{name}: expected shape (B + 1,) with B >= 0 clouds, got "
            f"{tuple(offsets.shape)}"
        )
    if device is not None and offsets.device != device:
        raise ValueError(
            f"{name}: expected a tensor on {device} like p_query, got {offsets.device}"
        )
    if values and not is_fake(offsets) and not torch.compiler.is_compiling():
        first, last = int(offsets[0]), int(offsets[-1])
        if first != 0:
            raise ValueError(f"{name}: expected offsets starting at 0, got {first}")
        if bool((offsets.diff() < 0).any()):
            raise ValueError(f"{name}: expected non-decreasing offsets")
        if last != n_points:
            raise ValueError(
                f"{name}: expected the last offset to be the number of points, "
                f"{n_points}, got {last}"
            )
    return offsets.shape[0] - 1


def check_batch(
    query_offsets: object,
    ref_offsets: object,
    n_query: int,
    n_ref: int,
    *,
    values: bool = True,
    device: torch.device | None = None,
) -> int:
    """Both offsets checked (:func:`check_offsets`), with as many clouds of queries as
    of references (the queries of cloud ``b`` search cloud ``b``); returns ``B``."""
    kw = {"values": values, "device": device}
    b_query = check_offsets("query_offsets", query_offsets, n_query, **kw)
    b_ref = check_offsets("ref_offsets", ref_offsets, n_ref, **kw)
    if b_query != b_ref:
        raise ValueError(
            f"query_offsets, ref_offsets: expected as many clouds of queries as of "
            f"reference points, got {b_query} and {b_ref}"
        )
    return b_query


def check_clouds_hold(
    query_offsets: torch.Tensor, ref_offsets: torch.Tensor, k: int
) -> None:
    """That every cloud with queries holds at least ``k`` reference points (eager
    only); the error names the first cloud that does not."""
    if is_fake(ref_offsets) or torch.compiler.is_compiling():
        return
    sizes, queries = ref_offsets.diff(), query_offsets.diff()
    short = ((sizes < k) & (queries > 0)).nonzero()
    if short.numel():
        b = int(short[0, 0])
        raise ValueError(
            f"ref_offsets: expected cloud {b} to hold at least k = {k} reference "
            f"points for its {int(queries[b])} queries, got {int(sizes[b])}"
        )


def check_call(
    query_offsets: object,
    ref_offsets: object,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    k: int = 0,
    *,
    values: bool = True,
) -> bool:
    """The offsets of a call of an entry point: both or neither, on the clouds' device,
    of as many clouds each (:func:`check_batch`) and, for a search of ``k`` neighbours,
    every cloud with queries holding ``k`` reference points (:func:`check_clouds_hold`,
    where ``values``). Returns whether the call is batched."""
    if query_offsets is None and ref_offsets is None:
        return False
    if query_offsets is None or ref_offsets is None:
        missing = "query_offsets" if query_offsets is None else "ref_offsets"
        raise ValueError(
            f"{missing}: expected both query_offsets and ref_offsets, or neither"
        )
    check_batch(
        query_offsets,
        ref_offsets,
        p_query.shape[0],
        p_ref.shape[0],
        values=values,
        device=p_query.device,
    )
    if k and values:
        check_clouds_hold(query_offsets, ref_offsets, k)
    return True


def cloud_of(offsets: torch.Tensor, n_points: int) -> torch.Tensor:
    """``(n_points,)`` int64 cloud of each point; tensor operations only, so that it
    compiles without reading the offsets on the host."""
    rows = torch.arange(n_points, device=offsets.device)
    return torch.searchsorted(offsets, rows, right=True) - 1


def per_cloud(op: str, fn: Callable) -> Callable:
    """A batched ``op`` from its single-cloud implementation ``fn``: one call per cloud
    with queries, the results concatenated, a search's indices shifted by the cloud's
    first reference row. A cloud without reference points gives no neighbour: zeros for
    an aggregation (as for a query without neighbours). Reads the offsets on the host,
    so it does not compile; gradients flow through the slices and the concatenation."""

    def looped(p_query, p_ref, *args, query_offsets, ref_offsets, **options):
        q_at, r_at = query_offsets.tolist(), ref_offsets.tolist()
        parts = []
        for b in range(len(q_at) - 1):
            q = p_query[q_at[b] : q_at[b + 1]]
            r = p_ref[r_at[b] : r_at[b + 1]]
            if q.shape[0] == 0:
                continue
            if op == "knn":
                d, i = fn(q, r, *args, **options)
                parts.append((d, i + r_at[b]))
                continue
            feats, *rest = args
            if r.shape[0] == 0:
                parts.append(feats.new_zeros((q.shape[0], feats.shape[1])))
                continue
            parts.append(fn(q, r, feats[r_at[b] : r_at[b + 1]], *rest, **options))
        if op == "knn":
            return torch.cat([d for d, _ in parts]), torch.cat([i for _, i in parts])
        return torch.cat(parts)

    return looped
