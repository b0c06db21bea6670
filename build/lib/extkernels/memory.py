"""One memory pool for PyTorch, CuPy and cuML: RMM as PyTorch's allocator (chapter 4).

PyTorch's caching allocator and RMM (which cuML allocates its temporaries from) keep
separate pools, and by default RMM's is no pool at all: every temporary cuML needs is a
``cudaMalloc`` and a ``cudaFree``, each of which synchronises the device.
:func:`use_rmm_pool` makes one RMM pool serve all three libraries.

It must run before PyTorch allocates anything on the GPU: PyTorch's allocator can be
chosen once per process, and ``change_current_allocator`` refuses once the default one
is in use.
"""

from __future__ import annotations

import torch

__all__ = ["use_rmm_pool", "rmm_statistics"]


def use_rmm_pool(
    initial_pool_size: int | None = 2**30,
    statistics: bool = True,
    *,
    pytorch: bool = True,
) -> None:
    """Make one RMM pool the allocator of PyTorch, CuPy and cuML in this process.

    Args:
        initial_pool_size: bytes reserved up front (the pool grows on demand).
        statistics: wrap the pool in RMM's statistics adaptor, which stands in for
            ``torch.cuda.max_memory_allocated`` (PyTorch keeps no statistics for a
            pluggable allocator).
        pytorch: also make the pool PyTorch's allocator. ``False`` gives the pool to
            CuPy and cuML only, and PyTorch keeps its caching allocator: two pools, the
            control that tells a pool for RAPIDS apart from one pool *shared* with
            PyTorch (chapter 4).

    Raises:
        RuntimeError: when PyTorch has already allocated GPU memory in this process.
    """
    if pytorch and torch.cuda.is_initialized():
        raise RuntimeError(
            "use_rmm_pool: CUDA is already initialised in this process, and with it "
            "PyTorch's "
            "default allocator; call this first thing, before any tensor is created on "
            "the GPU"
        )
    import cupy
    import rmm
    from rmm.allocators.cupy import rmm_cupy_allocator
    from rmm.allocators.torch import rmm_torch_allocator

    rmm.reinitialize(pool_allocator=True, initial_pool_size=initial_pool_size)
    if statistics:
        rmm.mr.set_current_device_resource(
            rmm.mr.StatisticsResourceAdaptor(rmm.mr.get_current_device_resource())
        )
    if pytorch:
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    cupy.cuda.set_allocator(rmm_cupy_allocator)


def rmm_statistics() -> dict[str, float]:
    """Current and peak memory (in MiB, 2**20 bytes) and allocation counts of RMM's
    statistics adaptor."""
    import rmm

    mr = rmm.mr.get_current_device_resource()
    if not isinstance(mr, rmm.mr.StatisticsResourceAdaptor):
        raise RuntimeError(
            "rmm_statistics: the current RMM resource keeps no statistics "
            "(use_rmm_pool(statistics=True))"
        )
    counts = mr.allocation_counts
    return {
        "current_mb": counts.current_bytes / 2**20,
        "peak_mb": counts.peak_bytes / 2**20,
        "allocations": counts.total_count,
    }
