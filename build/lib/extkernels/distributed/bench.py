"""Timing the layouts on one, two or four devices (chapter 13).

:func:`measure` runs on every rank of a launch of ``max(worlds)`` ranks. For each world
size ``w`` it forms the group of the first ``w`` ranks (the others wait), and for each
layout and cloud size it times the forward pass and the training step by the book's
protocol: warm-up, then blocks of ``n_iters`` calls
(:func:`~extkernels.timing.time_blocks`).
A rank's time is the median block; the row keeps the slowest rank's, since a step ends
when its last rank does. One launch is one run; the command repeats launches in fresh
processes and reports medians and spreads over them.

With ``profile_steps``, rank 0 profiles training steps at the largest size of the
``single`` layout and of the ``reference`` layout at every world size, so that one
device's step can be set beside one rank's share of it, kernel by kernel;
:func:`communication_share` sums the device time of the collectives' kernels (NCCL's
on a GPU, gloo's operators on the CPU).
"""

from __future__ import annotations

import gc
import math

import pandas as pd
import torch
import torch.distributed as dist
from torch.autograd import DeviceType

from ..ops.checks import value_checks
from ..problem import Problem
from ..profiling import profile, top_kernels
from ..timing import peak_memory_mb, time_blocks, timings_frame
from .launch import max_over_ranks
from .setups import make_setup

__all__ = ["measure", "communication_share", "device_parts", "part_of", "table"]


def communication_share(prof) -> dict:
    """Milliseconds per iteration spent in communication, and its share of all device
    time (on the CPU: of the operators' own CPU time)."""
    n = getattr(prof, "n_iters", 1)
    on_gpu = getattr(prof, "device_type", "cpu") == "cuda"
    total = comm = 0.0
    for e in prof.key_averages():
        if on_gpu and e.device_type == DeviceType.CUDA:
            t = e.self_device_time_total
            is_comm = "nccl" in e.key.lower()
        elif not on_gpu and e.device_type == DeviceType.CPU:
            t = e.self_cpu_time_total
            is_comm = "gloo" in e.key.lower() or "c10d" in e.key.lower()
        else:
            continue
        total += t
        comm += t if is_comm else 0.0
    return {
        "comm_ms": comm / 1e3 / n,
        "total_ms": total / 1e3 / n,
        "comm_share": comm / total if total else math.nan,
    }


def part_of(operator: str) -> str:
    """The part of a step an operator belongs to: ``matrix products`` (``aten::mm``,
    ``aten::addmm``: the MLPs' bulk), ``the book's kernels`` (any operator of the
    book's libraries, autograd's node of one included: its forward's kernels run under
    ``GeneratedBackwardFor_extkernels_...``), or ``everything else``."""
    if operator in ("aten::mm", "aten::addmm"):
        return "matrix products"
    if "extkernels" in operator:
        return "the book's kernels"
    return "everything else"


def device_parts(prof) -> dict:
    """Milliseconds per iteration of a profiled step in the parts of
    :func:`part_of`, and their total. An operator's time is its self time on the
    device (on the CPU, its self CPU time), as in
    :func:`~extkernels.profiling.top_kernels`."""
    n = getattr(prof, "n_iters", 1)
    on_gpu = getattr(prof, "device_type", "cpu") == "cuda"
    parts = dict.fromkeys(
        ["matrix products", "the book's kernels", "everything else"], 0.0
    )
    for e in prof.key_averages():
        if e.device_type != DeviceType.CPU:
            continue
        t = (e.self_device_time_total if on_gpu else e.self_cpu_time_total) / 1e3 / n
        parts[part_of(e.key)] += t
    return dict(parts, total=sum(parts.values()))


def _time(setup, prob: Problem, blocks: int) -> dict:
    step = setup.train_step()
    for _ in range(prob.n_warmup):
        setup.forward()
        step()
    with value_checks(False):
        fwd = time_blocks(setup.forward, prob.n_iters, blocks)
        train = time_blocks(step, prob.n_iters, blocks)
        peak = peak_memory_mb(step, setup.p_ref.device)
    return {"forward_ms": fwd[0], "train_ms": train[0], "peak_mb": peak}


def measure(
    device: torch.device,
    workload: str,
    prob: Problem,
    *,
    sizes: list[int],
    worlds: list[int],
    layouts: list[str],
    backend: str = "fused",
    compile: bool = False,
    blocks: int = 3,
    profile_steps: int = 0,
) -> dict:
    """Time every (world, layout, size) of one workload; call on every rank.

    Returns:
        ``{"rows": [...], "profiles": [...]}`` (rank 0's is the one to keep): a row
        per configuration with ``workload``, ``layout``, ``world``, ``n_ref``,
        ``n_query``, ``forward_ms``, ``train_ms`` and ``peak_mb`` (the slowest
        rank's); a profile per profiled configuration, with its communication share
        and top kernels.
    """
    rank = dist.get_rank()
    out_rows, profiles = [], []
    for w in worlds:
        group = dist.new_group(list(range(w)))  # every rank takes part in creating it
        for layout in layouts:
            if layout == "single" and w != 1:
                continue
            for n in sizes:
                if rank < w:
                    setup = make_setup(
                        workload,
                        layout,
                        prob,
                        device=device,
                        n_ref=n,
                        backend=backend,
                        compile=compile,
                        group=group,
                    )
                    row = max_over_ranks(_time(setup, prob, blocks), group)
                    largest = n == max(sizes)
                    if profile_steps and largest and layout in ("single", "reference"):
                        step = setup.train_step()
                        if rank == 0:
                            prof = profile(step, device=device, n_iters=profile_steps)
                            profiles.append(
                                {
                                    "layout": layout,
                                    "world": w,
                                    "n_ref": n,
                                    **communication_share(prof),
                                    "parts": device_parts(prof),
                                    "top": top_kernels(prof, top=12).to_dict("records"),
                                }
                            )
                        else:
                            for _ in range(1 + profile_steps):
                                step()
                    if rank == 0:
                        out_rows.append(
                            {
                                "workload": workload,
                                "layout": layout + ("+compile" if compile else ""),
                                "world": w,
                                "n_ref": n,
                                "n_query": prob.n_query,
                                **row,
                            }
                        )
                    del setup
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                dist.barrier()
    return {"rows": out_rows, "profiles": profiles}


def table(rows: list[dict]) -> pd.DataFrame:
    """Rows of repeated launches as one table: median and range over the runs
    (:func:`~extkernels.timing.timings_frame`, a configuration per variant)."""
    keys = ["workload", "layout", "world", "n_ref", "n_query"]
    named = [dict(r, variant="/".join(str(r[k]) for k in keys)) for r in rows]
    out = timings_frame(named).drop(columns=["run"], errors="ignore")
    out = out.astype({"world": int, "n_ref": int, "n_query": int})  # not medians
    return out.reset_index(drop=True).rename(columns={"repeats": "runs"})
