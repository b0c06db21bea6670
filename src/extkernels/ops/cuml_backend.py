"""The ``cuml`` backend: RAPIDS cuML's nearest-neighbour search (chapter 3).

Two ways to call the same search:

- :func:`knn_plain` calls cuML directly, handing the tensors over through DLPack without a
  copy. ``torch.compile`` cannot trace into cuML, so a compiled model breaks its graph here.
- ``torch.ops.cuml.knn`` wraps the same call as a PyTorch custom operator with a fake
  implementation: the compiler treats it as one opaque node whose output shapes it knows, and
  ``torch.compile(fullgraph=True)`` succeeds.

cuML takes no stream argument and waits on the host before it returns, so the operator
synchronises PyTorch's current stream before handing the inputs over, copies the results into
memory PyTorch owns (nothing returned aliases cuML's buffers), and carries the
``cudagraph_unsafe`` tag: a host synchronisation cannot be captured in a CUDA graph, and the
tag tells inductor to leave the operator out of any graph it captures.

Neither distances nor indices need a gradient: the weights depend only on geometry, and the
features receive their gradient through the gather in
:func:`~extkernels.ops.torch_backend.softmax_gather`.
"""

from __future__ import annotations

import importlib.util

import torch

from .checks import check_cloud, check_k, check_same_device
from .registry import register
from .torch_backend import softmax_gather

__all__ = ["knn_plain", "knn_op", "available"]


def available() -> bool:
    """cuML is installed and a CUDA device is present (cuML is not imported here)."""
    return torch.cuda.is_available() and importlib.util.find_spec("cuml") is not None


def _search(p_query: torch.Tensor, p_ref: torch.Tensor, k: int):
    """cuML's kNN on DLPack views of the inputs; returns cuML-owned CuPy arrays."""
    import cupy
    from cuml.neighbors import NearestNeighbors

    # Zero-copy views: the CuPy arrays point at the tensors' own memory.
    ref = cupy.from_dlpack(p_ref.detach())
    query = cupy.from_dlpack(p_query.detach())
    nn = NearestNeighbors(n_neighbors=k, output_type="cupy").fit(ref)
    return nn.kneighbors(query, n_neighbors=k, return_distance=True)


def knn_plain(
    p_query: torch.Tensor, p_ref: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuML's kNN called directly (no custom operator): ``(M, k)`` float32 distances ascending
    and ``(M, k)`` int64 indices. Breaks the graph of a compiled caller."""
    distances, indices = _search(p_query, p_ref, k)
    return torch.from_dlpack(distances).float(), torch.from_dlpack(indices).long()


# cudagraph_unsafe (torch >= 2.9): inductor's CUDA graphs partition around this operator.
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("cuml::knn", mutates_args=(), device_types="cuda", tags=_TAGS)
def knn_op(p_query: torch.Tensor, p_ref: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k nearest reference points by cuML, as a PyTorch operator.

    Args:
        p_query: ``(M, 3)`` float32 CUDA, contiguous.
        p_ref: ``(N, 3)`` float32 CUDA, contiguous, finite.
        k: ``1 <= k <= N``.

    Returns:
        distances ``(M, k)`` float32 ascending, indices ``(M, k)`` int64; fresh tensors owned by
        PyTorch's allocator, ready on the current stream.
    """
    check_cloud("p_query", p_query)
    check_cloud("p_ref", p_ref)
    check_same_device(p_query=p_query, p_ref=p_ref)
    check_k(k, p_ref.shape[0])
    stream = torch.cuda.current_stream(p_query.device)
    # cuML runs on its own stream: the inputs must be complete before it reads them.
    stream.synchronize()
    distances, indices = _search(p_query, p_ref, k)
    out_d = torch.empty((p_query.shape[0], k), dtype=torch.float32, device=p_query.device)
    out_i = torch.empty((p_query.shape[0], k), dtype=torch.int64, device=p_query.device)
    # Copy out of cuML's buffers on PyTorch's stream and wait for the copy, so that those
    # buffers may be freed (and reused by cuML) as soon as this function returns.
    out_d.copy_(torch.from_dlpack(distances))
    out_i.copy_(torch.from_dlpack(indices))
    stream.synchronize()
    return out_d, out_i


@knn_op.register_fake
def _knn_fake(p_query: torch.Tensor, p_ref: torch.Tensor, k: int):
    # The same metadata checks as the real operator, so a compiled caller fails at trace time.
    check_cloud("p_query", p_query)
    check_cloud("p_ref", p_ref)
    check_k(k, p_ref.shape[0])
    m = p_query.shape[0]
    return p_query.new_empty((m, k)), p_query.new_empty((m, k), dtype=torch.int64)


@register("knn", "cuml", devices=("cuda",), available=available)
def knn(
    p_query: torch.Tensor, p_ref: torch.Tensor, k: int, *, as_op: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuML kNN through the custom operator (``as_op=True``) or called directly."""
    if as_op:
        return torch.ops.cuml.knn(p_query, p_ref, k)
    return knn_plain(p_query, p_ref, k)


@register("knn_aggregate", "cuml", devices=("cuda",), available=available)
def knn_aggregate(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    k: int,
    sigma: float,
    *,
    as_op: bool = True,
) -> torch.Tensor:
    """kNN-weighted aggregation with cuML's search and PyTorch's differentiable gather."""
    with torch.no_grad():
        distances, indices = knn(p_query, p_ref, k, as_op=as_op)
    return softmax_gather(distances, indices, feats, sigma)
