"""Handing PyTorch's tensors and streams to Warp with little work per call (chapter 7).

The warp backend's operators and chapter 7's experiments use these public helpers:

- :func:`warp`: Warp, imported and initialised on first use (importing the package does
  not);
- :func:`where`: the Warp device of a tensor and, on CUDA, PyTorch's current stream as a
  Warp stream, so Warp's work is ordered with PyTorch's without any synchronisation;
- :func:`descriptor`: an array descriptor over a tensor's memory, kept for the next
  call;
- :func:`launch`: a kernel launch recorded once and replayed with new arguments;
- :func:`registered_capture`: tells Warp that PyTorch is capturing a CUDA graph.

Each keeps its state in an object of its own (:class:`StreamWrappers`,
:class:`DescriptorCache`, :class:`RecordedLaunches`), one per process.
"""

# No ``from __future__ import annotations``: nothing here needs it, and the kernels'
# module (which Warp reads) follows the same rule.
import contextlib
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "warp",
    "Where",
    "where",
    "descriptor",
    "points_array",
    "launch",
    "registered_capture",
    "StreamWrappers",
    "DescriptorCache",
    "RecordedLaunches",
]


@functools.cache
def warp() -> Any:
    """Import and initialise Warp once; returns the ``warp`` module."""
    import warp as wp

    # No banner and no per-module load messages in the chapters' outputs; warnings still
    # show.
    wp.config.quiet = True
    if hasattr(wp, "LOG_WARNING"):
        wp.config.log_level = max(wp.config.log_level, wp.LOG_WARNING)
    wp.init()
    return wp


def warp_started() -> bool:
    """Whether :func:`warp` has run in this process (without starting Warp)."""
    return warp.cache_info().currsize > 0


# ---------------------------------------------------------------- devices and streams


@dataclass(frozen=True)
class Where:
    """Where a call runs: the Warp device and, on CUDA, the Warp wrapper of PyTorch's
    current stream and that stream's ``(device index, handle)`` (both ``None`` on the
    CPU)."""

    device: Any
    stream: Any
    stream_key: tuple | None


class StreamWrappers:
    """One Warp wrapper per PyTorch stream, kept for the life of the process: creating
    one registers the stream with Warp, and dropping it would release Warp's per-stream
    scratch space (and its registration with a capture in progress)."""

    def __init__(self) -> None:
        self._wrappers: dict[tuple[int, int], Any] = {}
        self._devices: dict[torch.device, Any] = {}

    def where(self, device: torch.device) -> Where:
        wp_device = self._devices.get(device)
        if wp_device is None:
            wp_device = self._devices[device] = warp().device_from_torch(device)
        if device.type != "cuda":
            return Where(wp_device, None, None)
        torch_stream = torch.cuda.current_stream(device)
        key = (torch_stream.device_index, torch_stream.cuda_stream)
        stream = self._wrappers.get(key)
        if stream is None:
            stream = self._wrappers[key] = warp().stream_from_torch(torch_stream)
        return Where(wp_device, stream, key)


_STREAMS = StreamWrappers()


def where(device: torch.device) -> Where:
    """The Warp device of ``device`` and, on CUDA, PyTorch's current stream there as a
    Warp stream. Every launch goes to that stream."""
    return _STREAMS.where(device)


# ---------------------------------------------------------------- descriptors


class DescriptorCache:
    """Warp views of tensors' memory, kept by everything that defines them.

    A descriptor is a value: the address, shape and byte strides of some memory. The one
    made for a tensor serves every later tensor with the same address, shape, strides,
    dtype and device, and in a training loop PyTorch's caching allocator hands the same
    addresses back every iteration, so a steady loop converts nothing. The key holds the
    dtype because the byte strides depend on it (an int64 tensor at the address of an
    earlier float32 one of the same shape needs twice the strides), and the device
    because two devices may use the same address. Emptied when full.
    """

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._views: dict[tuple, Any] = {}

    def get(self, key: tuple, make) -> Any:
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= self.size:
                self._views.clear()
            view = self._views[key] = make()
        return view

    def __len__(self) -> int:
        return len(self._views)

    def clear(self) -> None:
        self._views.clear()


DESCRIPTORS = DescriptorCache()


def descriptor(t: torch.Tensor, dtype: Any = None) -> Any:
    """A Warp array descriptor over ``t``'s memory (no copy, no gradient buffer);
    ``dtype`` is the Warp element type when it is not the tensor's own (``wp.vec3`` for
    a cloud).

    A kept descriptor must not keep the tensor alive (nor, through it, its autograd
    graph): ``wp.from_torch`` makes a Warp array that holds the tensor, and only that
    array's C descriptor (``__ctype__``: pointers, shape and strides as numbers) is
    kept. The caller holds the tensor while the kernel that reads it is queued, and the
    allocator's stream order does the rest.
    """

    def make() -> Any:
        return warp().from_torch(t, dtype=dtype, requires_grad=False).__ctype__()

    key = ("desc", t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, dtype)
    return DESCRIPTORS.get(key, make)


def points_array(p: torch.Tensor, device: Any) -> Any:
    """A ``wp.array`` of ``vec3`` over ``p``'s memory, for :meth:`warp.HashGrid.build`
    (which takes arrays, not descriptors), kept like a descriptor. It is made from the
    pointer, so it does not keep ``p`` alive either."""
    wp = warp()
    return DESCRIPTORS.get(
        ("points", p.data_ptr(), p.shape[0], p.dtype, device.alias),
        lambda: wp.array(
            ptr=p.data_ptr(), dtype=wp.vec3, shape=(p.shape[0],), device=device
        ),
    )


# ---------------------------------------------------------------- launches


class RecordedLaunches:
    """Launch commands recorded once per kernel, adjoint flag and device, per thread
    (the forward runs on the caller's thread, the backward on autograd's device thread;
    a command must not be re-parametrised by two threads at once)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def launch(
        self,
        kernel: Any,
        dim: tuple,
        inputs: list,
        where: Where,
        adj_inputs: list | None,
    ) -> None:
        adjoint = adj_inputs is not None
        key = (kernel.key, adjoint, where.device.alias)
        commands = self._local.__dict__
        entry = commands.get(key)
        if entry is None:
            cmd = warp().launch(
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
            # Only what changed since the last launch is written: a kept descriptor is
            # the same object again, a scalar compares by value.
            for i, value in enumerate(inputs):
                if (
                    value is not None
                    and value is not last_inputs[i]
                    and value != last_inputs[i]
                ):
                    cmd.set_param_at_index_from_ctype(i, value)
                    last_inputs[i] = value
            for i, value in enumerate(adj_inputs or ()):
                if (
                    value is not None
                    and value is not last_adj[i]
                    and value != last_adj[i]
                ):
                    cmd.set_param_at_index_from_ctype(i, value, adjoint=True)
                    last_adj[i] = value
        cmd.launch(where.stream)


_LAUNCHES = RecordedLaunches()


def launch(
    kernel: Any, dim: tuple, inputs: list, where: Where, adj_inputs: list | None = None
) -> None:
    """Launch ``kernel`` (its adjoint when ``adj_inputs`` is given) on ``where``'s
    stream.

    ``wp.launch`` converts and checks every argument on every call. Here the first
    launch of a kernel on a device records a :class:`warp.Launch` command
    (``wp.launch(..., record_cmd=True)``); later launches only overwrite its parameters
    with the new descriptors and scalars (``set_param_at_index_from_ctype``, no
    conversion) and replay it. ``None`` array arguments stay as recorded (null arrays),
    so they must be ``None`` on every call of the same kernel.
    """
    _LAUNCHES.launch(kernel, dim, inputs, where, adj_inputs)


# ---------------------------------------------------------------- CUDA graphs


@contextlib.contextmanager
def registered_capture() -> Iterator[None]:
    """Tell Warp that PyTorch is capturing its current stream (an *external* capture),
    so that Warp allocates the hash-grid sort's scratch memory in the graph, freed with
    it. Nothing to tell when Warp has not run in this process."""
    if not warp_started():
        yield
        return
    wp = warp()
    stream = where(torch.device("cuda", torch.cuda.current_device())).stream
    wp.capture_begin(stream=stream, external=True, capture_mode=wp.CaptureMode.GLOBAL)
    try:
        yield
    finally:
        wp.capture_end(stream=stream)
