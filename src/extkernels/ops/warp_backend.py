"""The ``warp`` backend: radius aggregation with NVIDIA Warp's hash grid.

The brute force of chapter 1 compares every query with every reference point. Warp's
:class:`warp.HashGrid` sorts the reference points into cubic cells of width ``radius``, so a
query visits at most the 3 x 3 x 3 cells around it, and the cost grows with the number of actual
neighbours instead of ``M x N``.

The kernels walk the grid around each query:

1. ``normaliser`` (one thread per query, one walk with an online rescaling) finds the nearest
   neighbour's distance ``d0``, sums ``exp((d0 - d) / sigma)`` over the neighbours within
   ``radius`` and stores ``d0`` and ``1 / sum`` per query. The shift by ``d0`` cancels in the
   normalised weights and keeps ``exp`` from underflowing, as in the torch reference; the sum
   is clamped to float32's ``tiny``, so an empty neighbourhood gives zeros.
2. ``aggregate`` (one thread per query and chunk of four features, launch dimension
   ``(M, ceil(F / 4))``) sums ``exp((d0 - d) / sigma) * feats[j, f]`` in registers over the
   same walk, given ``d0`` and ``1 / sum``, and writes each ``out[q, f]`` once. Neighbouring
   threads read neighbouring features of the same reference point, so the reads of ``feats``
   coalesce; four features a thread amortise the walk, whose geometry would otherwise be
   recomputed for every feature.
3. ``aggregate_online`` is 1 and 2 in one walk, and it is what the forward launches: each
   thread keeps its weighted sums relative to the nearest neighbour seen so far and rescales
   them when a nearer one turns up. It writes the output and, from the first chunk's thread,
   ``d0`` and ``1 / sum`` for the backward.

``aggregate`` is linear in ``feats`` once the normalisers are known, so Warp can differentiate
it: the backward launches its *adjoint* (``wp.launch(..., adjoint=True)``) with the
normalisers the forward stored, and Warp's autodiff scatters ``w_qj / sum_q * grad_out[q, f]``
into ``grad_feats[j, f]`` with atomic adds. Warp's adjoint replays the dynamic grid loop and is
exact for ``feats``, because the loop only accumulates into its accumulators
(read-modify-writes, which Warp reverses); it would not be for the online kernel, whose
rescaling depends on the order of the neighbours and on sums not final until the loop ends.
The same scatter written by hand is the ``manual`` backward. ``normaliser`` runs only when a
backward finds no normalisers to reuse.

Operators (each with a fake implementation running the same metadata checks, so
``torch.compile(fullgraph=True)`` traces through them without a graph break):

- ``warp::radius_aggregate``: the forward, differentiable in ``feats`` through
  :func:`torch.library.register_autograd`, its backward calling
- ``warp::radius_aggregate_backward``: Warp's adjoint of the ``aggregate`` kernel;
- ``warp::radius_aggregate_manual``: the same forward, its backward calling
- ``warp::radius_aggregate_backward_manual``: the hand-written scatter kernel.

The backend's ``backward="adjoint" | "manual"`` picks the forward operator. The choice is an
operator name on purpose: a setting read by the autograd formula would be read once, at trace
time, and compiled-graph caches (in memory and on disk) do not know about it.

**How the hash grid reaches the backward.** A grid is a Warp object, not a tensor, so it cannot
be an operator argument. The forward always builds a fresh grid and leaves it, with the
per-query normalisers, in a small LRU cache (:data:`GRID_CACHE_SIZE` entries) keyed by what
they depend on: the identity and contents version ``(data_ptr, _version, shape, device)`` of
both clouds, ``radius`` and ``sigma``. The backward takes them out by the same key, and
rebuilds both when they are not there (evicted, or an input changed in place). Grid *objects*
no kernel will read any more are kept (:data:`SPARE_GRIDS` per device and stream) and rebuilt
in place by later forwards on the same stream: a rebuild reuses their buffers, so no call
allocates or frees a grid in steady state, yet no call reuses another's contents.
The lookup happens inside the backward operator's real implementation, at run time,
so it works in eager mode and under ``torch.compile``, where ``setup_context`` runs once at
trace time on fake tensors. Grids of forwards that never see a backward (inference) are
evicted by later ones; :func:`clear_grid_cache` frees them at once.

**No hidden synchronisation.** Tensors are handed to Warp as array descriptors over their own
memory (``wp.from_torch(..., return_ctype=True)``, no copy). On CUDA, everything (the grid's
stream-ordered allocations, its build, the kernels) runs on PyTorch's current stream (the
build inside ``wp.ScopedStream``, the kernels by the stream argument of their launch),
outputs and adjoint buffers are PyTorch tensors, and the host never waits for the device. A
grid is dropped only once a CUDA event recorded after its last kernel has completed, so its
memory cannot be reused under a kernel still reading it.

**Little work per call.** A training step is short enough here that the host's Python, not
the GPU, sets its pace, so the operators keep their per-call work small: one walk in the
forward, descriptors instead of ``wp.array`` objects (kept by address, see :func:`_desc`),
launches replayed from recorded :class:`warp.Launch` commands (see :func:`_launch`), grids
rebuilt in place, and no event unless a grid is dropped. Chapter 7 measures each of these.

**CUDA graphs.** The operators can be captured in a CUDA graph (:mod:`extkernels.graphs`
captures the whole forward pass or training step), with the grid built inside the graph at
every replay. One trap needs a guard. Warp ends a CUDA build by copying the grid's descriptor
(its array pointers, point count and cell width) from a host variable to the device, and a
captured copy reads that host variable again at every replay; Warp keeps one such variable
for all grids, holding the descriptor of whichever grid was built last. Replayed after any
other grid's build, the graph would hand its kernels the other grid's arrays. So every CUDA
grid keeps a device copy of its own descriptor (refreshed after an eager build that changed
the point count or the cell width, the only fields a rebuild changes), and a captured call
queries the grid through that copy, which no replay writes. A capture takes a grid that an
eager warm-up built at the same sizes on the capturing stream, and the grid then belongs to
the graph (:func:`~extkernels.ops.capture.keep_alive`): it never returns to the spare grids.

The one exception to "no synchronisation" is the check that the coordinates are
finite, which needs their values on the host: it runs by default, as in every other backend,
and :func:`~extkernels.ops.checks.value_checks` turns it off where that synchronisation must go
(timing runs).
In eager mode the public entry point :func:`extkernels.radius_aggregate` checks the values
once more before dispatching (and synchronises for it); call ``torch.ops.warp.*`` directly or
compile the caller to avoid that.
Because of the Python-side grid cache and that check, the operators carry the
``cudagraph_unsafe`` tag: inductor leaves them out of CUDA graphs.

Warp is imported on first use, not at package import: the operators and the backend are
registered here, the kernels are compiled (and cached on disk by Warp) on the first call.
"""

# No ``from __future__ import annotations`` here: Warp reads the kernels' annotations as objects.
import contextlib
import functools
import importlib.util
import math
import threading
import types
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import capture
from .checks import (
    check_cloud,
    check_feats,
    check_positive,
    check_same_device,
)
from .registry import register

__all__ = [
    "available",
    "init",
    "radius_aggregate_op",
    "radius_aggregate_manual_op",
    "radius_aggregate_backward_op",
    "radius_aggregate_backward_manual_op",
    "radius_aggregate",
    "grid_cache_size",
    "clear_grid_cache",
    "GRID_CACHE_SIZE",
    "BACKWARDS",
]

#: Most hash grids kept between a forward and its backward (least recently built evicted first).
GRID_CACHE_SIZE = 4
#: Cells per axis of a grid on CUDA (cells wrap around, so any cloud fits; 128^3 cells cost
#: 16 MB and keep aliased cells rare for clouds up to ~128 radii across).
CUDA_GRID_DIM = 128
#: Upper bound of the cells per axis on the CPU, where the grid is sized to the cloud.
CPU_GRID_DIM_MAX = 64
#: Bytes of Warp's float32 grid descriptor (``wp::HashGrid_t<float>``, Warp's hashgrid.h), the
#: device copy a captured call queries; :func:`_check_descriptor_layout` checks it.
GRID_DESCRIPTOR_BYTES = 88
#: The backward implementations: Warp's adjoint of the forward kernel, or the hand-written one.
BACKWARDS = ("adjoint", "manual")
# Smallest normal float32: the clamp of the torch reference's normaliser.
_TINY = float(torch.finfo(torch.float32).tiny)


def available() -> bool:
    """Warp is installed (it is not imported here)."""
    return importlib.util.find_spec("warp") is not None


# ---------------------------------------------------------------- Warp, lazily


@functools.cache
def _warp() -> Any:
    """Import and initialise Warp once (this prints Warp's banner)."""
    import warp as wp

    # No banner and no per-module load messages in the chapters' outputs; warnings still show.
    wp.config.quiet = True
    if hasattr(wp, "LOG_WARNING"):
        wp.config.log_level = max(wp.config.log_level, wp.LOG_WARNING)
    wp.init()
    return wp


def init() -> Any:
    """Import and initialise Warp now (chapters call it in their first cells, so that Warp's
    one-time messages land there); returns the ``warp`` module."""
    return _warp()


@functools.cache
def _kernels() -> Any:
    """Define the Warp kernels once; Warp compiles them per device on first launch."""
    wp = _warp()

    @wp.kernel
    def normaliser(
        grid: wp.uint64,
        p_query: wp.array(dtype=wp.vec3),
        p_ref: wp.array(dtype=wp.vec3),
        radius: float,
        sigma: float,
        shift: wp.array(dtype=float),
        inv_norm: wp.array(dtype=float),
    ):
        # One thread per query, one walk over the grid: the nearest in-radius distance d0 and
        # 1 / sum_j exp((d0 - d_qj) / sigma) over d_qj <= radius. When a nearer neighbour turns
        # up, the partial sum is rescaled to the new shift (an online softmax). The shift
        # cancels in the normalised weights and keeps exp() from underflowing when radius /
        # sigma is large.
        q = wp.tid()
        x = p_query[q]
        nearest = float(radius)
        total = float(0.0)  # noqa: UP018 (a variable, not a constant, for Warp's loop)
        for j in wp.hash_grid_query(grid, x, radius):
            d = wp.length(x - p_ref[j])
            if d <= radius:
                if d < nearest:
                    total = total * wp.exp((d - nearest) / sigma)
                    nearest = d
                total += wp.exp((nearest - d) / sigma)
        shift[q] = nearest
        # Clamped like the torch reference: an empty neighbourhood has total == 0 and its
        # output stays 0 (0 * 1 / tiny), without an infinity.
        inv_norm[q] = 1.0 / wp.max(total, _TINY)

    @wp.kernel
    def aggregate(
        grid: wp.uint64,
        p_query: wp.array(dtype=wp.vec3),
        p_ref: wp.array(dtype=wp.vec3),
        feats: wp.array2d(dtype=float),
        shift: wp.array(dtype=float),
        inv_norm: wp.array(dtype=float),
        radius: float,
        sigma: float,
        out: wp.array2d(dtype=float),
    ):
        # One thread per query and chunk of CHUNK features: registers accumulate the weighted
        # features over one grid walk, and each out[q, f] is written once. A chunk amortises
        # the walk over 4 features; the columns past F are clamped on load and never stored,
        # so they receive no gradient. Linear in feats, hence differentiable by Warp (its
        # adjoint reverses the read-modify-writes of the accumulators).
        q, c = wp.tid()
        nf = feats.shape[1]
        f0 = c * 4
        f1 = wp.min(f0 + 1, nf - 1)
        f2 = wp.min(f0 + 2, nf - 1)
        f3 = wp.min(f0 + 3, nf - 1)
        x = p_query[q]
        d0 = shift[q]
        a0 = float(0.0)  # noqa: UP018
        a1 = float(0.0)  # noqa: UP018
        a2 = float(0.0)  # noqa: UP018
        a3 = float(0.0)  # noqa: UP018
        for j in wp.hash_grid_query(grid, x, radius):
            d = wp.length(x - p_ref[j])
            if d <= radius:
                w = wp.exp((d0 - d) / sigma)
                a0 += w * feats[j, f0]
                a1 += w * feats[j, f1]
                a2 += w * feats[j, f2]
                a3 += w * feats[j, f3]
        s = inv_norm[q]
        out[q, f0] = a0 * s
        if f0 + 1 < nf:
            out[q, f0 + 1] = a1 * s
        if f0 + 2 < nf:
            out[q, f0 + 2] = a2 * s
        if f0 + 3 < nf:
            out[q, f0 + 3] = a3 * s

    @wp.kernel
    def scatter(
        grid: wp.uint64,
        p_query: wp.array(dtype=wp.vec3),
        p_ref: wp.array(dtype=wp.vec3),
        shift: wp.array(dtype=float),
        inv_norm: wp.array(dtype=float),
        radius: float,
        sigma: float,
        grad_out: wp.array2d(dtype=float),
        grad_feats: wp.array2d(dtype=float),
    ):
        # The hand-written backward: grad_feats[j, f] += w_qj / sum_q * grad_out[q, f] for every
        # neighbour j of q, CHUNK features per thread. Several queries share a neighbour, hence
        # the atomic adds.
        q, c = wp.tid()
        nf = grad_out.shape[1]
        f0 = c * 4
        x = p_query[q]
        d0 = shift[q]
        s = inv_norm[q]
        g0 = grad_out[q, f0] * s
        g1 = float(0.0)  # noqa: UP018
        g2 = float(0.0)  # noqa: UP018
        g3 = float(0.0)  # noqa: UP018
        if f0 + 1 < nf:
            g1 = grad_out[q, f0 + 1] * s
        if f0 + 2 < nf:
            g2 = grad_out[q, f0 + 2] * s
        if f0 + 3 < nf:
            g3 = grad_out[q, f0 + 3] * s
        for j in wp.hash_grid_query(grid, x, radius):
            d = wp.length(x - p_ref[j])
            if d <= radius:
                w = wp.exp((d0 - d) / sigma)
                wp.atomic_add(grad_feats, j, f0, w * g0)
                if f0 + 1 < nf:
                    wp.atomic_add(grad_feats, j, f0 + 1, w * g1)
                if f0 + 2 < nf:
                    wp.atomic_add(grad_feats, j, f0 + 2, w * g2)
                if f0 + 3 < nf:
                    wp.atomic_add(grad_feats, j, f0 + 3, w * g3)

    @wp.kernel(enable_backward=False)
    def aggregate_online(
        grid: wp.uint64,
        p_query: wp.array(dtype=wp.vec3),
        p_ref: wp.array(dtype=wp.vec3),
        feats: wp.array2d(dtype=float),
        radius: float,
        sigma: float,
        out: wp.array2d(dtype=float),
        shift: wp.array(dtype=float),
        inv_norm: wp.array(dtype=float),
    ):
        # The forward in one walk: `normaliser` and `aggregate` fused. The thread keeps the
        # nearest distance so far, the sum of the weights and the weighted features, all
        # relative to that nearest distance; a nearer neighbour rescales them (an online
        # softmax). The result equals `aggregate` after `normaliser` up to rounding, and the
        # first chunk's thread stores the final shift and 1 / sum for the backward, which
        # differentiates `aggregate` (this loop's rescaling is not for Warp to reverse).
        q, c = wp.tid()
        nf = feats.shape[1]
        f0 = c * 4
        f1 = wp.min(f0 + 1, nf - 1)
        f2 = wp.min(f0 + 2, nf - 1)
        f3 = wp.min(f0 + 3, nf - 1)
        x = p_query[q]
        nearest = float(radius)
        total = float(0.0)  # noqa: UP018
        a0 = float(0.0)  # noqa: UP018
        a1 = float(0.0)  # noqa: UP018
        a2 = float(0.0)  # noqa: UP018
        a3 = float(0.0)  # noqa: UP018
        for j in wp.hash_grid_query(grid, x, radius):
            d = wp.length(x - p_ref[j])
            if d <= radius:
                if d < nearest:
                    scale = wp.exp((d - nearest) / sigma)
                    total = total * scale
                    a0 = a0 * scale
                    a1 = a1 * scale
                    a2 = a2 * scale
                    a3 = a3 * scale
                    nearest = d
                w = wp.exp((nearest - d) / sigma)
                total += w
                a0 += w * feats[j, f0]
                a1 += w * feats[j, f1]
                a2 += w * feats[j, f2]
                a3 += w * feats[j, f3]
        s = 1.0 / wp.max(total, _TINY)
        out[q, f0] = a0 * s
        if f0 + 1 < nf:
            out[q, f0 + 1] = a1 * s
        if f0 + 2 < nf:
            out[q, f0 + 2] = a2 * s
        if f0 + 3 < nf:
            out[q, f0 + 3] = a3 * s
        if c == 0:
            shift[q] = nearest
            inv_norm[q] = s

    return types.SimpleNamespace(
        normaliser=normaliser,
        aggregate=aggregate,
        aggregate_online=aggregate_online,
        scatter=scatter,
    )


# ---------------------------------------------------------------- streams, descriptors, launches


@dataclass(frozen=True)
class _Where:
    """Where a call runs: the Warp device and, on CUDA, the Warp wrapper of PyTorch's current
    stream and that stream's ``(device index, handle)`` (both ``None`` on the CPU)."""

    device: Any
    stream: Any
    stream_key: tuple | None


@functools.cache
def _warp_device(device: torch.device) -> Any:
    return _warp().device_from_torch(device)


_streams: dict[tuple[int, int], Any] = {}


def _where(device: torch.device) -> _Where:
    """The Warp device of ``device`` and, on CUDA, PyTorch's current stream there as a Warp
    stream. Every launch goes to that stream, so Warp work is ordered with PyTorch's without
    any synchronisation."""
    wp_device = _warp_device(device)
    if device.type != "cuda":
        return _Where(wp_device, None, None)
    torch_stream = torch.cuda.current_stream(device)
    key = (torch_stream.device_index, torch_stream.cuda_stream)
    stream = _streams.get(key)
    if stream is None:
        # One Warp wrapper per PyTorch stream, kept: creating one registers the stream with
        # Warp, and dropping it releases Warp's per-stream sort scratch space.
        stream = _streams[key] = _warp().stream_from_torch(torch_stream)
    return _Where(wp_device, stream, key)


#: Features per thread of the aggregate and scatter kernels (the kernels' four accumulators).
CHUNK = 4


def _chunks(n_features: int) -> int:
    """Threads per query: one per CHUNK features."""
    return -(-n_features // CHUNK)


#: Most array descriptors (and Warp arrays) kept for reuse; the cache is emptied when full.
DESC_CACHE_SIZE = 64
_descs: dict[tuple, Any] = {}


def _kept(key: tuple, make) -> Any:
    """The view kept under ``key``, or a new one from ``make()``, kept for next time."""
    view = _descs.get(key)
    if view is None:
        if len(_descs) >= DESC_CACHE_SIZE:
            _descs.clear()
        view = _descs[key] = make()
    return view


def _desc(t: torch.Tensor, dtype: Any = None) -> Any:
    """A Warp array descriptor over ``t``'s memory (no copy, no gradient buffer).

    A descriptor is a value: the address, shape and strides of the memory. The one made for
    an address, shape, strides and dtype therefore serves every later tensor with the same
    ones, and in a training loop PyTorch's caching allocator hands the same addresses back
    every iteration: the descriptors are cached by those values, and a steady loop converts
    nothing. ``wp.from_torch`` also attaches the tensor to its descriptor, to keep it alive
    while the descriptor is in use; a kept descriptor must not keep it (nor, through it,
    its autograd graph), so that reference is dropped: the caller holds the tensor while
    the kernel that reads it is queued, and the allocator's stream order does the rest.
    """

    def make() -> Any:
        desc = _warp().from_torch(t, dtype=dtype, requires_grad=False, return_ctype=True)
        desc._ref = desc._gradref = None
        return desc

    return _kept((t.data_ptr(), t.shape, t.stride(), dtype), make)


def _points_array(p: torch.Tensor, device: Any) -> Any:
    """A ``wp.array`` of ``vec3`` over ``p``'s memory, for :meth:`warp.HashGrid.build` (which
    takes arrays, not descriptors); cached by address and size like :func:`_desc`. It is made
    from the pointer, so it does not keep ``p`` alive, as a descriptor does not."""
    wp = _warp()
    return _kept(
        ("points", p.data_ptr(), p.shape[0], device.alias),
        lambda: wp.array(ptr=p.data_ptr(), dtype=wp.vec3, shape=(p.shape[0],), device=device),
    )


# Recorded launch commands, per thread (the forward runs on the caller's thread, the backward on
# autograd's device thread; a command must not be re-parametrised by two threads at once).
_commands = threading.local()


def _launch(
    kernel: Any, dim: tuple, inputs: list, where: _Where, adj_inputs: list | None = None
) -> None:
    """Launch ``kernel`` (its adjoint when ``adj_inputs`` is given) on ``where``'s stream.

    ``wp.launch`` converts and checks every argument on every call. Here the first launch of a
    kernel on a device records a :class:`warp.Launch` command (``wp.launch(...,
    record_cmd=True)``); later launches only overwrite its parameters with the new descriptors
    and scalars (``set_param_at_index_from_ctype``, no conversion) and replay it.
    ``None`` array arguments stay as recorded (null arrays), so they must be ``None`` on every
    call of the same kernel.
    """
    adjoint = adj_inputs is not None
    key = (kernel.key, adjoint, where.device.alias)
    commands = _commands.__dict__
    entry = commands.get(key)
    if entry is None:
        cmd = _warp().launch(
            kernel,
            dim=dim,
            inputs=inputs,
            adj_inputs=adj_inputs or [],
            adjoint=adjoint,
            device=where.device,
            record_cmd=True,
        )
        commands[key] = [cmd, dim, list(inputs), list(adj_inputs or ())]
    else:
        cmd, last_dim, last_inputs, last_adj = entry
        if dim != last_dim:
            cmd.set_dim(dim)
            entry[1] = dim
        # Only what changed since the last launch is written: a cached descriptor (see
        # _desc) is the same object again, a scalar compares by value.
        for i, value in enumerate(inputs):
            if value is not None and value is not last_inputs[i] and value != last_inputs[i]:
                cmd.set_param_at_index_from_ctype(i, value)
                last_inputs[i] = value
        for i, value in enumerate(adj_inputs or ()):
            if value is not None and value is not last_adj[i] and value != last_adj[i]:
                cmd.set_param_at_index_from_ctype(i, value, adjoint=True)
                last_adj[i] = value
    cmd.launch(where.stream)


# ---------------------------------------------------------------- the grid cache


@dataclass
class _Entry:
    """What a forward leaves for its backward: the grid, the per-query normalisers (tensors
    and their descriptors), the descriptors of the two clouds, and where its kernels ran."""

    grid: Any
    grid_id: int  # what the kernels query: grid.id, or its descriptor copy inside a capture
    norms: tuple  # (shift, inv_norm) tensors, kept alive for their descriptors
    norm_descs: tuple
    points: tuple  # descriptors of (p_query, p_ref)
    where: _Where


_grids: "OrderedDict[tuple, _Entry]" = OrderedDict()
_lock = threading.Lock()


def _tensor_key(t: torch.Tensor) -> tuple:
    # _version changes with every in-place write, so a tensor modified after the forward does not
    # match; data_ptr + shape + device tell tensors apart.
    return (t.data_ptr(), t._version, tuple(t.shape), t.device)


def _grid_key(p_query: torch.Tensor, p_ref: torch.Tensor, radius: float, sigma: float) -> tuple:
    """Everything the cached data depends on: the grid on ``p_ref`` and ``radius``, the
    normalisers also on ``p_query`` and ``sigma``."""
    return (_tensor_key(p_query), _tensor_key(p_ref), float(radius), float(sigma))


#: Spare grid objects kept per (device, stream, cell dimensions) for the next build.
SPARE_GRIDS = 2
_spare: dict[tuple, list[Any]] = {}
# Grids being dropped, each with a torch.cuda.Event recorded after its last kernel.
_retired: list[tuple[Any, Any]] = []


def _retire(entry: _Entry) -> None:
    """Hand back the grid of ``entry`` once its kernels are queued: no call reads it any more.

    It joins the spare grids of the stream its kernels ran on, and the next forward on that
    stream rebuilds it in place: the rebuild's kernels queue behind the kernels that read it,
    so stream order alone makes the reuse safe, without an event or a wait, and no call
    allocates or frees a grid in steady state. Only when the spares are full is a grid
    dropped, and on CUDA not before an event recorded now has completed: Warp frees a grid's
    memory with a stream-ordered free that does not wait for work on PyTorch's other streams.
    """
    grid, where = entry.grid, entry.where
    if getattr(grid, "captured", False):
        return  # the graph that captured it holds it
    spare = _spare.setdefault((where.device.alias, where.stream_key, grid.cell_dims), [])
    if len(spare) < SPARE_GRIDS or capture.capturing():
        # (during a capture nothing may be freed or recorded outside the graph: keep it)
        spare.append(grid)
    elif where.stream is not None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(torch.device("cuda", where.device.ordinal)))
        _retired.append((grid, event))
    # else a CPU grid: its kernels have finished when their launch returns, drop it now


def _collect() -> None:
    """Drop the retired grids whose kernels have completed (a non-blocking event query)."""
    if _retired and not capture.capturing():  # no event query during a capture
        _retired[:] = [(grid, event) for grid, event in _retired if not event.query()]


def _build_grid(p_ref: torch.Tensor, radius: float, where: _Where) -> tuple[Any, int]:
    """A fresh hash grid over ``p_ref``, cells of width ``radius``, built on ``where``'s stream.

    Returns the grid and the id the kernels query it by (see :func:`_descriptor_copy`).
    """
    wp = _warp()
    device = where.device
    capturing = where.stream is not None and capture.capturing()
    if device.is_cuda:
        dims = (CUDA_GRID_DIM,) * 3
    else:
        # On the CPU the values are at hand: size the grid to the cloud's bounding box (cells
        # beyond it would only wrap around), which keeps the per-build clearing of cells small.
        extent = (p_ref.amax(dim=0) - p_ref.amin(dim=0)).tolist()
        dims = tuple(
            max(1, min(CPU_GRID_DIM_MAX, int(e / radius) + 1))
            if math.isfinite(e)
            else CPU_GRID_DIM_MAX
            for e in extent
        )
    key = (device.alias, where.stream_key, dims)
    with _lock:
        _collect()
        if capturing and not _spare.get(key):
            _release_stream(where.stream_key)  # forwards of the warm-up left their grids cached
        spare = _spare.get(key)
        grid = spare.pop() if spare else None
    if grid is None:
        if capturing:
            raise RuntimeError(
                "warp::radius_aggregate: a CUDA graph capture needs a hash grid built eagerly "
                "on the capturing stream first; run the captured function once before capture"
            )
        grid = wp.HashGrid(*dims, device=device)
        grid.cell_dims = dims  # part of the key under which _retire keeps it
        grid.descriptor_for = None
    points = _points_array(p_ref, device)
    if where.stream is None:
        grid.build(points, radius)
        return grid, grid.id
    # The build's sort and its stream-ordered allocations go to the device's current stream.
    with wp.ScopedStream(where.stream, sync_enter=False):
        grid.build(points, radius)
        if capturing:
            return grid, _captured_id(grid, p_ref.shape[0], radius)
        _descriptor_copy(grid, p_ref.shape[0], radius, p_ref.device)
    return grid, grid.id


def _descriptor_copy(grid: Any, n_points: int, radius: float, device: torch.device) -> None:
    """Refresh the grid's device copy of its descriptor after an eager build that changed it.

    A build rewrites the descriptor's point count and cell width, and its array pointers only
    when more points than ever need larger arrays; so a copy made after a build with the same
    point count and cell width is still exact, and a steady loop copies nothing. The copy
    runs on the build's stream, after it.
    """
    if grid.descriptor_for == (n_points, radius):
        return
    wp = _warp()
    if grid.descriptor_for is None:
        grid.descriptor = torch.empty(GRID_DESCRIPTOR_BYTES, dtype=torch.uint8, device=device)
        grid.descriptor_views = tuple(
            wp.array(ptr=ptr, dtype=wp.uint8, shape=(GRID_DESCRIPTOR_BYTES,), device=grid.device)
            for ptr in (grid.descriptor.data_ptr(), grid.id)
        )
    wp.copy(*grid.descriptor_views)
    grid.descriptor_for = (n_points, radius)


def _captured_id(grid: Any, n_points: int, radius: float) -> int:
    """The id a captured call queries ``grid`` by: its descriptor copy (see the module
    docstring), which the eager warm-up made at these sizes. The grid now belongs to the graph."""
    _check_descriptor_layout()
    if grid.descriptor_for != (n_points, radius):
        raise RuntimeError(
            "warp::radius_aggregate: a CUDA graph capture needs a hash grid built eagerly at the "
            f"same size first ({n_points} points, radius {radius}); run the captured function "
            "once before capture"
        )
    grid.captured = True
    capture.keep_alive(grid)
    return grid.descriptor.data_ptr()


@capture.register_hook
@contextlib.contextmanager
def _registered_capture() -> Iterator[None]:
    """Tell Warp that PyTorch is capturing its current stream (an *external* capture), so
    that Warp allocates the hash-grid sort's scratch memory in the graph, freed with it.
    Nothing to tell when Warp has not run in this process."""
    if _warp.cache_info().currsize == 0:
        yield
        return
    wp = _warp()
    stream = _where(torch.device("cuda", torch.cuda.current_device())).stream
    wp.capture_begin(stream=stream, external=True, capture_mode=wp.CaptureMode.GLOBAL)
    try:
        yield
    finally:
        wp.capture_end(stream=stream)


@functools.cache
def _check_descriptor_layout() -> None:
    """Check that Warp's float32 grid descriptor is the :data:`GRID_DESCRIPTOR_BYTES`-byte
    struct the descriptor copies assume, by reading a small CPU grid's (the same struct, in
    host memory): its last fields, the cell width and its inverse, end at that size."""
    import ctypes

    wp = _warp()
    grid = wp.HashGrid(3, 4, 5, device="cpu")
    grid.build(wp.zeros(7, dtype=wp.vec3, device="cpu"), 0.25)
    raw = ctypes.string_at(grid.id, GRID_DESCRIPTOR_BYTES)
    dims_and_count = tuple(int.from_bytes(raw[o : o + 4], "little") for o in (40, 44, 48, 52))
    widths = tuple(ctypes.c_float.from_buffer_copy(raw, o).value for o in (80, 84))
    if dims_and_count != (3, 4, 5, 7) or widths != (0.25, 4.0):
        raise RuntimeError(
            f"Warp {wp.__version__}: the hash grid descriptor is not the layout the warp "
            "backend copies for CUDA graphs; capture its operators with an earlier Warp"
        )


def _release_stream(stream_key: tuple | None) -> None:
    """Hand the cached grids of forwards on ``stream_key`` to the spare grids (caller holds
    the lock): a capture on a stream of its own takes the warm-up's grids over."""
    for key in [k for k, e in _grids.items() if e.where.stream_key == stream_key]:
        _retire(_grids.pop(key))


def _put_grid(key: tuple, entry: _Entry) -> None:
    """Leave what a forward computed in the cache for its backward."""
    with _lock:
        old = _grids.pop(key, None)
        if old is not None:
            _retire(old)
        _grids[key] = entry
        while len(_grids) > GRID_CACHE_SIZE:
            _retire(_grids.popitem(last=False)[1])


def _take_grid(key: tuple) -> _Entry | None:
    """The entry a forward left under ``key``, removed from the cache, or ``None`` when it is not
    there (evicted, or an input changed in place)."""
    with _lock:
        return _grids.pop(key, None)


def grid_cache_size() -> int:
    """Number of hash grids waiting in the cache for a backward pass."""
    with _lock:
        return len(_grids)


def clear_grid_cache() -> None:
    """Free every cached hash grid (for example after inference, which leaves them behind)."""
    with _lock:
        while _grids:
            _retire(_grids.popitem()[1])
        _collect()


# ---------------------------------------------------------------- the operators

# cudagraph_unsafe (torch >= 2.9): inductor's CUDA graphs partition around these operators.
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _check_inputs(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
    *,
    values: bool | None,
) -> tuple[float, float]:
    """The checks shared by every operator here: metadata always; finite coordinates too with
    ``values=None`` (the real forward), where :func:`~.checks.values_checked` allows it."""
    check_cloud("p_query", p_query, values=values)
    check_cloud("p_ref", p_ref, values=values)
    check_same_device(p_query=p_query, p_ref=p_ref)
    check_feats(feats, p_ref.shape[0])
    check_same_device(p_ref=p_ref, feats=feats)
    return check_positive("radius", radius), check_positive("sigma", sigma)


def _check_grad_out(grad_out: torch.Tensor, p_query: torch.Tensor, feats: torch.Tensor) -> None:
    if not isinstance(grad_out, torch.Tensor):
        raise TypeError(f"grad_out: expected a torch.Tensor, got {type(grad_out).__name__}")
    if grad_out.dtype != torch.float32:
        raise TypeError(f"grad_out: expected dtype torch.float32, got {grad_out.dtype}")
    want = (p_query.shape[0], feats.shape[1])
    if tuple(grad_out.shape) != want:
        raise ValueError(f"grad_out: expected shape {want} (M, F), got {tuple(grad_out.shape)}")
    if not grad_out.is_contiguous():
        raise ValueError("grad_out: expected a contiguous tensor (call .contiguous() first)")
    check_same_device(p_query=p_query, grad_out=grad_out)


def _new_entry(p_query: torch.Tensor, p_ref: torch.Tensor, radius: float, where: _Where) -> _Entry:
    """A fresh grid over ``p_ref``, the descriptors of both clouds, and room for the per-query
    normalisers ``shift`` (``d0``) and ``inv_norm`` (``1 / sum_j exp((d0 - d_qj) / sigma)``)."""
    wp = _warp()
    grid, grid_id = _build_grid(p_ref, radius, where)
    points = (_desc(p_query, wp.vec3), _desc(p_ref, wp.vec3))
    norms = torch.empty((2, p_query.shape[0]), dtype=torch.float32, device=p_query.device)
    shift, inv_norm = norms  # one allocation, two contiguous rows
    return _Entry(grid, grid_id, (shift, inv_norm), (_desc(shift), _desc(inv_norm)), points, where)


def _forward(
    p_query: torch.Tensor, p_ref: torch.Tensor, feats: torch.Tensor, radius: float, sigma: float
) -> torch.Tensor:
    """The real forward of both forward operators: build the grid, run the one-walk kernel,
    leave the grid and the normalisers in the cache for the backward."""
    radius, sigma = _check_inputs(p_query, p_ref, feats, radius, sigma, values=None)
    where = _where(p_ref.device)
    m, f = p_query.shape[0], feats.shape[1]
    entry = _new_entry(p_query, p_ref, radius, where)
    out = torch.empty((m, f), dtype=torch.float32, device=p_query.device)
    args = [entry.grid_id, *entry.points, _desc(feats), radius, sigma, _desc(out)]
    _launch(_kernels().aggregate_online, (m, _chunks(f)), [*args, *entry.norm_descs], where)
    # The backward needs the same grid and normalisers: leave them in the cache.
    _put_grid(_grid_key(p_query, p_ref, radius, sigma), entry)
    return out


def _forward_fake(
    p_query: torch.Tensor, p_ref: torch.Tensor, feats: torch.Tensor, radius: float, sigma: float
) -> torch.Tensor:
    # The same metadata checks as the real operator, so a compiled caller fails at trace time.
    _check_inputs(p_query, p_ref, feats, radius, sigma, values=False)
    return p_query.new_empty((p_query.shape[0], feats.shape[1]))


@torch.library.custom_op(
    "warp::radius_aggregate", mutates_args=(), device_types=("cpu", "cuda"), tags=_TAGS
)
def radius_aggregate_op(
    p_query: torch.Tensor, p_ref: torch.Tensor, feats: torch.Tensor, radius: float, sigma: float
) -> torch.Tensor:
    """Radius-bounded aggregation by Warp's hash grid, as a PyTorch operator whose backward is
    Warp's adjoint of the forward kernel (``warp::radius_aggregate_backward``).

    Args:
        p_query: ``(M, 3)`` float32, contiguous, finite.
        p_ref: ``(N, 3)`` float32, contiguous, finite, on the same device.
        feats: ``(N, F)`` float32, contiguous, on the same device.
        radius: neighbourhood radius, > 0 (also the grid's cell width).
        sigma: weight length scale, > 0.

    Returns:
        ``(M, F)`` float32: ``sum_j exp(-d_qj / sigma) / sum_j' exp(-d_qj' / sigma) * feats[j]``
        over ``d_qj <= radius``, zeros for a query without neighbour; a fresh tensor, ready on
        PyTorch's current stream. Leaves the hash grid in the cache for the backward.
    """
    return _forward(p_query, p_ref, feats, radius, sigma)


@torch.library.custom_op(
    "warp::radius_aggregate_manual", mutates_args=(), device_types=("cpu", "cuda"), tags=_TAGS
)
def radius_aggregate_manual_op(
    p_query: torch.Tensor, p_ref: torch.Tensor, feats: torch.Tensor, radius: float, sigma: float
) -> torch.Tensor:
    """The same forward as ``warp::radius_aggregate``, differentiated by the hand-written
    kernel (``warp::radius_aggregate_backward_manual``). Same arguments and result.

    The backward is chosen by the operator's name, not by a setting read while tracing: a
    compiled graph records which operator it calls, so compiled-graph caches cannot mix them up.
    """
    return _forward(p_query, p_ref, feats, radius, sigma)


radius_aggregate_op.register_fake(_forward_fake)
radius_aggregate_manual_op.register_fake(_forward_fake)


def _backward_impl(
    grad_out: torch.Tensor,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
    kind: str,
) -> torch.Tensor:
    # Metadata only: the forward checked the values.
    radius, sigma = _check_inputs(p_query, p_ref, feats, radius, sigma, values=False)
    _check_grad_out(grad_out, p_query, feats)
    k = _kernels()
    m, f = grad_out.shape
    where = _where(p_ref.device)
    entry = _take_grid(_grid_key(p_query, p_ref, radius, sigma))
    if entry is None:  # the forward's grid is gone: rebuild it and the normalisers
        entry = _new_entry(p_query, p_ref, radius, where)
        args = [entry.grid_id, *entry.points, radius, sigma, *entry.norm_descs]
        _launch(k.normaliser, (m,), args, where)
    # Fresh zeros every call: both kernels accumulate into grad_feats.
    grad_feats = torch.zeros_like(feats)
    common = [entry.grid_id, *entry.points]
    if kind == "adjoint":
        # The adjoint of `aggregate`: the forward arguments again, then one adjoint per
        # argument. Only feats and out have one; None is a null array (no gradient wanted) and
        # 0.0 the adjoint of a float argument. Warp's backward kernel never stores to the
        # forward output, so `out` is a null array too.
        _launch(
            k.aggregate,
            (m, _chunks(f)),
            [*common, _desc(feats), *entry.norm_descs, radius, sigma, None],
            where,
            adj_inputs=[0, None, None, _desc(grad_feats), None, None, 0.0, 0.0, _desc(grad_out)],
        )
    else:
        _launch(
            k.scatter,
            (m, _chunks(f)),
            [*common, *entry.norm_descs, radius, sigma, _desc(grad_out), _desc(grad_feats)],
            where,
        )
    with _lock:
        _retire(entry)
    return grad_feats


@torch.library.custom_op(
    "warp::radius_aggregate_backward", mutates_args=(), device_types=("cpu", "cuda"), tags=_TAGS
)
def radius_aggregate_backward_op(
    grad_out: torch.Tensor,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
) -> torch.Tensor:
    """Gradient of ``warp::radius_aggregate`` w.r.t. ``feats``, by Warp's adjoint of the forward
    kernel (``wp.launch(..., adjoint=True)``).

    Args:
        grad_out: ``(M, F)`` float32, contiguous: the gradient of the output.
        p_query, p_ref, feats, radius, sigma: the forward's arguments.

    Returns:
        ``(N, F)`` float32 ``grad_feats``, a fresh tensor. Takes the forward's hash grid out of
        the cache, or builds one.
    """
    return _backward_impl(grad_out, p_query, p_ref, feats, radius, sigma, "adjoint")


@torch.library.custom_op(
    "warp::radius_aggregate_backward_manual",
    mutates_args=(),
    device_types=("cpu", "cuda"),
    tags=_TAGS,
)
def radius_aggregate_backward_manual_op(
    grad_out: torch.Tensor,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
) -> torch.Tensor:
    """The same gradient as ``warp::radius_aggregate_backward``, by the hand-written scatter
    kernel (``feats`` gives only the output's shape). Returns ``(N, F)`` float32."""
    return _backward_impl(grad_out, p_query, p_ref, feats, radius, sigma, "manual")


def _backward_fake(
    grad_out: torch.Tensor,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
) -> torch.Tensor:
    _check_inputs(p_query, p_ref, feats, radius, sigma, values=False)
    _check_grad_out(grad_out, p_query, feats)
    return torch.empty_like(feats)


radius_aggregate_backward_op.register_fake(_backward_fake)
radius_aggregate_backward_manual_op.register_fake(_backward_fake)


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    p_query, p_ref, feats, radius, sigma = inputs
    # Tensors for the backward; the hash grid is not among them (see the module docstring).
    ctx.save_for_backward(p_query, p_ref, feats)
    ctx.radius, ctx.sigma = radius, sigma


def _autograd_formula(backward_op):
    """The backward of a forward operator, calling ``backward_op`` for the gradient of ``feats``."""

    def backward(ctx, grad_out: torch.Tensor):
        p_query, p_ref, feats = ctx.saved_tensors
        grad_feats = None
        if ctx.needs_input_grad[2]:
            # The incoming gradient may be a broadcast view (the backward of a sum is an expand).
            grad_feats = backward_op(
                grad_out.contiguous(), p_query, p_ref, feats, ctx.radius, ctx.sigma
            )
        # Coordinates get no gradient: the weights are a function of geometry only, as in the
        # torch reference, which computes them under no_grad.
        return None, None, grad_feats, None, None

    return backward


torch.library.register_autograd(
    "warp::radius_aggregate",
    _autograd_formula(torch.ops.warp.radius_aggregate_backward),
    setup_context=_setup_context,
)
torch.library.register_autograd(
    "warp::radius_aggregate_manual",
    _autograd_formula(torch.ops.warp.radius_aggregate_backward_manual),
    setup_context=_setup_context,
)


# ---------------------------------------------------------------- the backend


@register("radius_aggregate", "warp", devices=("cpu", "cuda"), available=available)
def radius_aggregate(
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    feats: torch.Tensor,
    radius: float,
    sigma: float,
    *,
    backward: str = "adjoint",
) -> torch.Tensor:
    """Radius-bounded aggregation by ``torch.ops.warp.radius_aggregate``; returns ``(M, F)``.

    ``backward="manual"`` calls ``torch.ops.warp.radius_aggregate_manual`` instead: the same
    forward, differentiated by the hand-written kernel instead of Warp's adjoint.
    """
    if backward == "adjoint":
        return torch.ops.warp.radius_aggregate(p_query, p_ref, feats, radius, sigma)
    if backward == "manual":
        return torch.ops.warp.radius_aggregate_manual(p_query, p_ref, feats, radius, sigma)
    raise ValueError(f"backward: expected one of {BACKWARDS}, got {backward!r}")
