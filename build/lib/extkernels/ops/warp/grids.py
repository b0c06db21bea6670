"""The hash grids of the warp backend, owned by one :class:`GridPool` (chapters 6-7).

**Forward to backward.** A grid is a Warp object, not a tensor, so it cannot be an
operator argument. The forward builds a fresh grid and leaves it, with the per-query
normalisers, in the pool's small LRU cache (:attr:`GridPool.cache_size` entries) under a
key of what they depend on: the identity and contents version of both clouds, ``radius``
and ``sigma`` (:func:`entry_key`). The backward takes them out by the same key, or
rebuilds both when they are gone (evicted, or an input changed in place). Grids of
forwards that never see a backward (inference) are evicted by later ones;
:meth:`GridPool.clear` frees everything at once.

**No allocation in steady state.** Grids no kernel will read any more become *spares* (a
few per device, stream and cell dimensions) and later forwards on the same stream
rebuild them in place: the rebuild's kernels queue behind the kernels that read the
grid, so stream order alone makes the reuse safe. Only when the spares are full is a
grid dropped, and on CUDA not before an event recorded after its last kernel has
completed (*retired* grids).

**CUDA graphs.** Warp ends a CUDA build by copying the grid's descriptor (array
pointers, point count, cell width) from one host variable that all float grids share; a
captured copy re-reads that variable at every replay, so a replay after any other grid's
build would search the other grid. Every CUDA grid therefore keeps a device copy of its
own descriptor (:class:`Grid`, refreshed after an eager build that changed the point
count or cell width, the only fields a rebuild changes), and a captured call queries the
grid through it. A capture takes a grid that an eager warm-up built at the same sizes on
the capturing stream; the grid then belongs to the graph
(:func:`~extkernels.ops.capture.keep_alive`), never to the spares.
"""

import ctypes
import functools
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from .. import capture
from .interop import Where, points_array, warp

__all__ = ["Grid", "Entry", "GridPool", "POOL", "entry_key", "GRID_DESCRIPTOR_BYTES"]

#: Cells per axis of a grid on CUDA (cells wrap around, so any cloud fits; 128^3 cells
#: cost 16 MiB and keep aliased cells rare for clouds up to ~128 radii across).
CUDA_GRID_DIM = 128
#: Upper bound of the cells per axis on the CPU, where the grid is sized to the cloud.
CPU_GRID_DIM_MAX = 64
#: Bytes of Warp's float32 grid descriptor (``wp::HashGrid_t<float>``, Warp's
#: hashgrid.h); :func:`check_descriptor_layout` checks it against the running Warp.
GRID_DESCRIPTOR_BYTES = 88


@dataclass
class Grid:
    """A Warp hash grid and what the backend knows about it."""

    grid: Any  # the warp.HashGrid
    dims: tuple[int, int, int]
    descriptor: torch.Tensor | None = None  # the device copy of its descriptor (CUDA)
    descriptor_views: tuple = ()  # (copy, original) as Warp byte arrays, for wp.copy
    descriptor_for: tuple | None = None  # (point count, cell width) of the copy
    captured: bool = False  # belongs to a CUDA graph

    def refresh_descriptor(
        self, n_points: int, radius: float, device: torch.device
    ) -> None:
        """Copy the descriptor after an eager build that changed it (on the build's
        stream). A rebuild with the same point count and cell width leaves it as it was:
        a steady loop copies nothing."""
        if self.descriptor_for == (n_points, radius):
            return
        wp = warp()
        if self.descriptor is None:
            self.descriptor = torch.empty(
                GRID_DESCRIPTOR_BYTES, dtype=torch.uint8, device=device
            )
            self.descriptor_views = tuple(
                wp.array(
                    ptr=p,
                    dtype=wp.uint8,
                    shape=(GRID_DESCRIPTOR_BYTES,),
                    device=self.grid.device,
                )
                for p in (self.descriptor.data_ptr(), self.grid.id)
            )
        wp.copy(*self.descriptor_views)
        self.descriptor_for = (n_points, radius)


@dataclass
class Entry:
    """What a forward leaves for its backward: the grid, the id its kernels query it by,
    the per-query normalisers (tensors and their descriptors), the descriptors of both
    clouds, and where its kernels ran."""

    grid: Grid
    grid_id: int  # grid.grid.id, or its descriptor copy inside a capture
    norms: torch.Tensor  # (2, M): rows shift and inv_norm, alive for their descriptors
    norm_descs: tuple
    points: tuple  # descriptors of (p_query, p_ref)
    where: Where


def _tensor_key(t: torch.Tensor) -> tuple:
    # _version changes with every in-place write, so a tensor modified after the forward
    # does not match; address, shape, dtype and device tell tensors apart.
    return (t.data_ptr(), t._version, tuple(t.shape), t.dtype, t.device)


def entry_key(
    p_query: torch.Tensor, p_ref: torch.Tensor, radius: float, sigma: float
) -> tuple:
    """Everything a kept entry depends on: the grid on ``p_ref`` and ``radius``, the
    normalisers also on ``p_query`` and ``sigma``."""
    return (_tensor_key(p_query), _tensor_key(p_ref), float(radius), float(sigma))


@functools.cache
def check_descriptor_layout() -> None:
    """Check that Warp's float32 grid descriptor is the
    :data:`GRID_DESCRIPTOR_BYTES`-byte struct the descriptor copies assume, by reading a
    small CPU grid's (the same struct, in host memory): its last fields, the cell width
    and its inverse, end at that size."""
    wp = warp()
    grid = wp.HashGrid(3, 4, 5, device="cpu")
    grid.build(wp.zeros(7, dtype=wp.vec3, device="cpu"), 0.25)
    raw = ctypes.string_at(grid.id, GRID_DESCRIPTOR_BYTES)
    dims_and_count = tuple(
        int.from_bytes(raw[o : o + 4], "little") for o in (40, 44, 48, 52)
    )
    widths = tuple(ctypes.c_float.from_buffer_copy(raw, o).value for o in (80, 84))
    if dims_and_count != (3, 4, 5, 7) or widths != (0.25, 4.0):
        raise RuntimeError(
            f"Warp {wp.__version__}: the hash grid descriptor is not the layout the "
            "warp "
            "backend copies for CUDA graphs; capture its operators with an earlier Warp"
        )


def _dims(p_ref: torch.Tensor, radius: float, device: Any) -> tuple[int, int, int]:
    if device.is_cuda:
        return (CUDA_GRID_DIM,) * 3
    # On the CPU the values are at hand: size the grid to the cloud's bounding box
    # (cells beyond it would only wrap around), which keeps the per-build clearing of
    # cells small.
    extent = (p_ref.amax(dim=0) - p_ref.amin(dim=0)).tolist()
    return tuple(
        max(1, min(CPU_GRID_DIM_MAX, int(e / radius) + 1))
        if math.isfinite(e)
        else CPU_GRID_DIM_MAX
        for e in extent
    )


class GridPool:
    """Every grid of the backend: kept for a backward, spare, or retired.

    Args:
        cache_size: most entries kept between a forward and its backward.
        spares: spare grids kept per device, stream and cell dimensions.
    """

    def __init__(self, cache_size: int = 4, spares: int = 2) -> None:
        self.cache_size, self.spares = cache_size, spares
        self._lock = threading.Lock()
        # Builds from several threads take turns: Warp's current stream (set by
        # ScopedStream) and the host copy of a grid's descriptor are per device, not per
        # thread.
        self._build_lock = threading.Lock()
        self._cache: OrderedDict[tuple, Entry] = OrderedDict()
        self._spare: dict[tuple, list[Grid]] = {}
        self._retired: list[
            tuple[Grid, Any]
        ] = []  # (grid, CUDA event after its last kernel)

    # ------------------------------------------------------------ what a forward leaves

    def put(self, key: tuple, entry: Entry) -> None:
        """Keep what a forward computed for its backward (evicting the oldest when
        full)."""
        with self._lock:
            old = self._cache.pop(key, None)
            if old is not None:
                self._retire(old)
            self._cache[key] = entry
            while len(self._cache) > self.cache_size:
                self._retire(self._cache.popitem(last=False)[1])

    def take(self, key: tuple) -> Entry | None:
        """The entry kept under ``key``, removed, or ``None`` when it is not there."""
        with self._lock:
            return self._cache.pop(key, None)

    def release(self, entry: Entry) -> None:
        """Hand back the grid of an entry whose kernels are all queued."""
        with self._lock:
            self._retire(entry)

    def cached(self) -> int:
        """Entries waiting for a backward."""
        with self._lock:
            return len(self._cache)

    def spare_grids(self) -> list[Grid]:
        """The spare grids ready to be rebuilt, every device and stream."""
        with self._lock:
            return [g for spares in self._spare.values() for g in spares]

    def spare_count(self) -> int:
        """How many spare grids there are."""
        return len(self.spare_grids())

    def clear(self) -> None:
        """Free every grid the pool holds: kept entries, spares and, once their kernels
        are done, retired grids (grids captured in a CUDA graph stay with their
        graph)."""
        with self._lock:
            while self._cache:
                self._drop(self._cache.popitem()[1])
            for spares in self._spare.values():
                while spares:
                    self._drop_grid(spares.pop())
            self._spare.clear()
            self._collect()

    # ------------------------------------------------------------ building

    def build(
        self, p_ref: torch.Tensor, radius: float, where: Where
    ) -> tuple[Grid, int]:
        """A grid over ``p_ref`` with cells of width ``radius``, built on ``where``'s
        stream: a spare rebuilt in place, or a new one. Returns it and the id the
        kernels query it by.
        """
        wp = warp()
        capturing = where.stream is not None and capture.capturing()
        dims = _dims(p_ref, radius, where.device)
        key = (where.device.alias, where.stream_key, dims)
        with self._lock:
            self._collect()
            if capturing and not self._spare.get(key):
                self._release_stream(
                    where.stream_key
                )  # the warm-up's forwards kept theirs
            spare = self._spare.get(key)
            grid = spare.pop() if spare else None
        if grid is None:
            if capturing:
                raise RuntimeError(
                    "warp::radius_aggregate: a CUDA graph capture needs a hash grid "
                    "built "
                    "eagerly on the capturing stream first; run the captured function "
                    "once "
                    "before capture"
                )
            grid = Grid(wp.HashGrid(*dims, device=where.device), dims)
        points = points_array(p_ref, where.device)
        with self._build_lock:
            if where.stream is None:
                grid.grid.build(points, radius)
                return grid, grid.grid.id
            # The build's sort and its stream-ordered allocations go to PyTorch's
            # stream.
            with wp.ScopedStream(where.stream, sync_enter=False):
                grid.grid.build(points, radius)
                if capturing:
                    return grid, self._captured_id(grid, p_ref.shape[0], radius)
                grid.refresh_descriptor(p_ref.shape[0], radius, p_ref.device)
            return grid, grid.grid.id

    @staticmethod
    def _captured_id(grid: Grid, n_points: int, radius: float) -> int:
        """The id a captured call queries ``grid`` by: its descriptor copy, which the
        eager warm-up made at these sizes. The grid now belongs to the graph."""
        check_descriptor_layout()
        if grid.descriptor_for != (n_points, radius):
            raise RuntimeError(
                "warp::radius_aggregate: a CUDA graph capture needs a hash grid built "
                "eagerly "
                f"at the same size first ({n_points} points, radius {radius}); run the "
                "captured function once before capture"
            )
        grid.captured = True
        capture.keep_alive(grid)
        return grid.descriptor.data_ptr()

    # ------------------------------------------------------------ handing grids back
    # (the callers hold the lock)

    def _retire(self, entry: Entry) -> None:
        """The grid of ``entry`` becomes a spare of the stream its kernels ran on, or,
        when the spares are full, is dropped once its kernels are done."""
        grid, where = entry.grid, entry.where
        if grid.captured:
            return  # the graph that captured it holds it
        spare = self._spare.setdefault(
            (where.device.alias, where.stream_key, grid.dims), []
        )
        if len(spare) < self.spares or capture.capturing():
            # (during a capture nothing may be freed or recorded outside the graph: keep
            # it)
            spare.append(grid)
        else:
            self._drop_grid(grid)

    def _drop(self, entry: Entry) -> None:
        if not entry.grid.captured:
            self._drop_grid(entry.grid)

    def _drop_grid(self, grid: Grid) -> None:
        """Let go of ``grid``: at once on the CPU, where its kernels have finished when
        their launch returns; on CUDA once an event recorded now has completed, since
        Warp frees a grid's memory with a stream-ordered free that does not wait for
        PyTorch's streams."""
        device = grid.grid.device
        if device.is_cuda and not capture.capturing():
            event = torch.cuda.Event()
            event.record(
                torch.cuda.current_stream(torch.device("cuda", device.ordinal))
            )
            self._retired.append((grid, event))

    def _collect(self) -> None:
        """Drop the retired grids whose kernels have completed (a non-blocking event
        query)."""
        if self._retired and not capture.capturing():  # no event query during a capture
            self._retired[:] = [(g, e) for g, e in self._retired if not e.query()]

    def _release_stream(self, stream_key: tuple | None) -> None:
        """Make the kept entries of forwards on ``stream_key`` spares: a capture on a
        stream of its own takes over the grids of its warm-up."""
        for key in [
            k for k, e in self._cache.items() if e.where.stream_key == stream_key
        ]:
            self._retire(self._cache.pop(key))


#: The backend's pool.
POOL = GridPool()
