"""The Triton kNN search as a PyTorch operator the compiler traces into (chapter 8).

``torch.library.triton_op`` registers a Python function that launches Triton kernels
through ``torch.library.wrap_triton``: in eager mode it runs as written; under
``torch.compile`` inductor traces into it and sees the kernel launch itself, so no fake
implementation is written by hand. ``register_kernel("cpu")`` gives the operator a CPU
implementation: the same kernel under Triton's interpreter when ``TRITON_INTERPRET=1``
(how the tests run it without a GPU), otherwise the brute force.
"""

# No ``from __future__ import annotations``: torch.library reads the annotations as
# types.
import torch
import triton
from torch.library import triton_op, wrap_triton

from ..checks import check_knn
from ..torch.brute_force import knn as brute_force_knn
from .kernels import knn_kernel, next_power_of_2

__all__ = ["knn_op", "BLOCK_Q", "BLOCK_R"]

#: Queries per program and reference points per step of its walk.
BLOCK_Q, BLOCK_R = 64, 64


def _launch(p_query, p_ref, k, block_q, block_r):
    m, n = p_query.shape[0], p_ref.shape[0]
    distances = p_query.new_empty((m, k))
    indices = p_query.new_empty((m, k), dtype=torch.int64)
    wrap_triton(knn_kernel)[(triton.cdiv(m, block_q),)](
        p_query,
        p_ref,
        distances,
        indices,
        m,
        n,
        K=k,
        KP=next_power_of_2(k),
        BLOCK_Q=block_q,
        BLOCK_R=block_r,
    )
    return distances, indices


@triton_op("triton_knn::knn", mutates_args=())
def knn_op(
    p_query: torch.Tensor, p_ref: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact k nearest reference points of every query, by a Triton kernel.

    Args:
        p_query: ``(M, 3)`` float32, contiguous, finite.
        p_ref: ``(N, 3)`` float32, contiguous, finite, on the same device.
        k: ``1 <= k <= N``.

    Returns:
        distances ``(M, k)`` float32 ascending, indices ``(M, k)`` int64; fresh tensors,
        ready on PyTorch's current stream. No host synchronisation.
    """
    k = check_knn(p_query, p_ref, k)
    if p_query.device.type != "cuda":
        # What the compiler traces for CPU tensors (eager CPU calls take the kernel
        # registered below): Triton compiles for GPUs only.
        return brute_force_knn(p_query, p_ref, k)
    return _launch(p_query, p_ref, k, BLOCK_Q, BLOCK_R)


@knn_op.register_kernel("cpu")
def _knn_cpu(p_query, p_ref, k):
    k = check_knn(p_query, p_ref, k)
    return brute_force_knn(p_query, p_ref, k)


@knn_op.register_fake
def _knn_fake(p_query, p_ref, k):
    k = check_knn(p_query, p_ref, k, values=False)
    m = p_query.shape[0]
    return p_query.new_empty((m, k)), p_query.new_empty((m, k), dtype=torch.int64)
