"""Chapter 5's build-up: from the smallest Warp operator to the book's forward kernel,
one reason at a time.

Each step is one Warp kernel, launched the plain way (``wp.from_torch``, a hash grid
built anew on every call, ``wp.launch`` on PyTorch's stream), so that the steps differ
only in their kernels:

1. every reference point for every query (the smallest operator, written in the
   chapter itself);
2. :data:`grid_sum`: the same sum over the hash grid's cells around the query;
3. :data:`grid_shifted`: weights relative to the nearest neighbour's distance, so that
   ``exp`` cannot underflow when the radius spans many ``sigma`` (two walks: the
   nearest distance first, then the sums);
4. :data:`grid_online`: both walks in one, the sums rescaled whenever a nearer
   neighbour turns up (an online softmax);
5. four features per thread: the book's kernel,
   :data:`extkernels.ops.warp.kernels.aggregate_online`.

:func:`run_step` launches any of them; :func:`time_steps` times a list of steps on one
problem. The book's operator, ``warp::radius_aggregate``, runs step 5 with the lighter
launches of chapter 7.
"""

# No ``from __future__ import annotations`` here: Warp reads the kernels' annotations as
# objects.
import contextlib
from collections.abc import Callable

import pandas as pd
import torch

from ..ops.torch.brute_force import radius_aggregate as brute_force
from ..ops.warp import kernels as book_kernels
from ..ops.warp.grids import CUDA_GRID_DIM
from ..ops.warp.interop import warp
from ..timing import time_blocks

__all__ = [
    "grid_sum",
    "grid_shifted",
    "grid_online",
    "run_step",
    "steps",
    "time_steps",
    "wrong_share",
    "ladder_numbers",
]

wp = warp()


@wp.kernel(enable_backward=False)
def grid_sum(
    grid: wp.uint64,
    q: wp.array(dtype=wp.vec3),
    p: wp.array(dtype=wp.vec3),
    x: wp.array2d(dtype=float),
    radius: float,
    sigma: float,
    out: wp.array2d(dtype=float),
):
    # Step 2: the smallest kernel's sums, over the cells around the query only.
    i, c = wp.tid()
    total, acc = wp.float32(0.0), wp.float32(0.0)  # variables: the loop adds to them
    for j in wp.hash_grid_query(grid, q[i], radius):
        d = wp.length(q[i] - p[j])
        if d <= radius:
            w = wp.exp(-d / sigma)
            total += w
            acc += w * x[j, c]
    out[i, c] = wp.where(total > 0.0, acc / total, 0.0)


@wp.kernel(enable_backward=False)
def grid_shifted(
    grid: wp.uint64,
    q: wp.array(dtype=wp.vec3),
    p: wp.array(dtype=wp.vec3),
    x: wp.array2d(dtype=float),
    radius: float,
    sigma: float,
    out: wp.array2d(dtype=float),
):
    # Step 3: weights relative to the nearest neighbour, found by a first walk.
    i, c = wp.tid()
    nearest = float(radius)
    for j in wp.hash_grid_query(grid, q[i], radius):
        nearest = wp.min(nearest, wp.length(q[i] - p[j]))
    total, acc = wp.float32(0.0), wp.float32(0.0)
    for j in wp.hash_grid_query(grid, q[i], radius):
        d = wp.length(q[i] - p[j])
        if d <= radius:
            w = wp.exp((nearest - d) / sigma)  # at most 1: no underflow of the sum
            total += w
            acc += w * x[j, c]
    out[i, c] = wp.where(total > 0.0, acc / total, 0.0)


@wp.kernel(enable_backward=False)
def grid_online(
    grid: wp.uint64,
    q: wp.array(dtype=wp.vec3),
    p: wp.array(dtype=wp.vec3),
    x: wp.array2d(dtype=float),
    radius: float,
    sigma: float,
    out: wp.array2d(dtype=float),
):
    # Step 4: one walk; the sums are rescaled whenever a nearer neighbour turns up.
    i, c = wp.tid()
    nearest = float(radius)
    total, acc = wp.float32(0.0), wp.float32(0.0)
    for j in wp.hash_grid_query(grid, q[i], radius):
        d = wp.length(q[i] - p[j])
        if d <= radius:
            if d < nearest:
                scale = wp.exp((d - nearest) / sigma)
                total = total * scale
                acc = acc * scale
                nearest = d
            w = wp.exp((nearest - d) / sigma)
            total += w
            acc += w * x[j, c]
    out[i, c] = wp.where(total > 0.0, acc / total, 0.0)


def run_step(kernel, grid, p_query, p_ref, feats, radius: float, sigma: float):
    """Build ``grid`` (a ``wp.HashGrid`` on the tensors' device) over ``p_ref`` and run
    ``kernel`` (:data:`grid_sum`, :data:`grid_shifted`, :data:`grid_online`, or the
    book's ``aggregate_online``, which takes four features per thread and also writes
    each query's shift and normaliser), on PyTorch's current stream.

    Args:
        p_query: ``(M, 3)`` float32; p_ref: ``(N, 3)`` float32; feats: ``(N, F)``
            float32, all contiguous on one device.

    Returns:
        ``(M, F)`` float32, the radius aggregation.
    """
    m, f = p_query.shape[0], feats.shape[1]
    out = feats.new_empty(m, f)
    q, p = (wp.from_torch(t, dtype=wp.vec3) for t in (p_query, p_ref))
    inputs = [grid.id, q, p, wp.from_torch(feats), radius, sigma]
    outputs = [wp.from_torch(out)]
    dim = (m, f)
    if kernel is book_kernels.aggregate_online:
        dim = (m, -(-f // book_kernels.CHUNK))
        outputs += [wp.from_torch(p_query.new_empty(m)) for _ in range(2)]
    stream = wp.stream_from_torch(p_query.device) if p_query.is_cuda else None
    with wp.ScopedStream(stream) if stream else contextlib.nullcontext():
        grid.build(points=p, radius=radius)  # anew on every call
        wp.launch(kernel, dim=dim, inputs=inputs, outputs=outputs, device=grid.device)
    return out


def steps(device: torch.device) -> dict[str, Callable]:
    """Steps 2 to 5 as functions of ``(p_query, p_ref, feats, radius, sigma)``, by the
    name chapter 5 gives them, sharing one hash grid on ``device``."""
    if device.type == "cuda" and device.index is None:  # Warp needs the ordinal
        device = torch.device("cuda", torch.cuda.current_device())
    dims = (CUDA_GRID_DIM,) * 3 if device.type == "cuda" else (32, 32, 32)
    grid = wp.HashGrid(*dims, device=wp.device_from_torch(device))
    kernels = {
        "hash grid": grid_sum,
        "shifted, two walks": grid_shifted,
        "online, one walk": grid_online,
        "four features per thread": book_kernels.aggregate_online,
    }
    return {
        name: lambda *args, kernel=kernel: run_step(kernel, grid, *args)
        for name, kernel in kernels.items()
    }


def time_steps(
    funcs: dict[str, Callable], args: tuple, *, n_iters: int, repeats: int = 5
) -> pd.DataFrame:
    """Milliseconds per call of each step (:func:`~extkernels.timing.time_blocks`: the
    median of ``repeats`` blocks of ``n_iters`` calls, with the fastest and slowest
    block), and how many times faster each is than the step before it.

    Args:
        funcs: step name -> function of ``args``, in the order of the build-up.
        args: ``(p_query, p_ref, feats, radius, sigma)``.
    """
    rows = {}
    for name, fn in funcs.items():
        median, low, high = time_blocks(lambda fn=fn: fn(*args), n_iters, repeats)
        rows[name] = {"ms per call": median, "fastest": low, "slowest": high}
    out = pd.DataFrame.from_dict(rows, orient="index").rename_axis("step")
    out["× the step before"] = out["ms per call"].shift(1) / out["ms per call"]
    return out


def wrong_share(
    funcs: dict[str, Callable], args: tuple, *, atol: float = 1e-4
) -> pd.Series:
    """For each step, the share (%) of queries whose output differs from the brute
    force's (chapter 1's PyTorch reference, which shifts its weights) by more than
    ``atol`` in some feature: how chapter 5 shows the underflow that step 3 removes.

    Args:
        funcs: step name -> function of ``args``.
        args: ``(p_query, p_ref, feats, radius, sigma)``.
    """
    expected = brute_force(*args)
    return pd.Series(
        {
            name: 100.0
            * float(((fn(*args) - expected).abs() > atol).any(1).float().mean())
            for name, fn in funcs.items()
        },
        name="queries wrong (%)",
    ).rename_axis("step")


def ladder_numbers(ladder: pd.DataFrame) -> dict[str, float]:
    """The numbers chapter 5 quotes from :func:`time_steps`' table (the smallest
    operator first, then the four steps by their names in :func:`steps`): how many
    times faster the hash grid is than the smallest operator (``steps_grid_gain``), and
    the book's kernel (``steps_total_gain``)."""
    ms = ladder["ms per call"]
    return {
        "steps_grid_gain": float(ms.iloc[0] / ms["hash grid"]),
        "steps_total_gain": float(ms.iloc[0] / ms["four features per thread"]),
    }
