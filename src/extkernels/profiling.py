"""``torch.profiler`` results as tables (chapter 1 introduces them; every chapter reuses
them).

:func:`profile` runs a function a few times under the profiler; :func:`top_kernels`
turns the result into a DataFrame of the operators that spend the most device time (on
the CPU: CPU time), with their share of the total, call count and memory.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable

import pandas as pd
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

# Kineto (torch 2.13) prints "USDT: ... profiler_start / profiler_stop" around every
# profile at a level above its errors; a reader who sets KINETO_LOG_LEVEL keeps theirs.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

__all__ = [
    "profile",
    "top_kernels",
    "stacked",
    "generated_kernels",
    "runtime_calls",
    "timeline",
    "gpu_busy_fraction",
    "kernels_per_iteration",
    "compiler_count",
    "reset_compiler",
]


def profile(
    fn: Callable[[], object], *, device: torch.device, n_iters: int = 3, warmup: int = 1
):
    """Run ``fn`` ``warmup`` times untraced, then ``n_iters`` times under
    ``torch.profiler``.

    Returns:
        The finished ``torch.profiler.profile`` object, with ``n_iters`` stored on it.
    """
    for _ in range(warmup):
        fn()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with torch.profiler.profile(
        activities=activities, profile_memory=True, acc_events=True
    ) as prof:
        for _ in range(n_iters):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    prof.n_iters = n_iters
    prof.device_type = device.type
    return prof


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def top_kernels(prof, top: int = 8, *, host: bool = False) -> pd.DataFrame:
    """The operators that spend the most time, per iteration.

    On a GPU the time is the *self device time* of each operator (the kernels it
    launched itself; inductor's generated Triton kernels appear under their own names);
    on the CPU, or with ``host=True``, it is the self CPU time: what the host spends in
    each operator and wrapper, the compiled function's own machinery included.
    ``share`` is the fraction of the total of that column.

    Returns:
        DataFrame with columns ``name``, ``time (ms)``, ``share (%)``, ``calls``,
        ``memory (MiB)``, one row per operator, largest first.
    """
    on_gpu = getattr(prof, "device_type", "cpu") == "cuda" and not host
    n = getattr(prof, "n_iters", 1)
    rows = []
    for evt in prof.key_averages():
        if evt.device_type != DeviceType.CPU:
            continue
        t = evt.self_device_time_total if on_gpu else evt.self_cpu_time_total
        mem = evt.self_device_memory_usage if on_gpu else evt.self_cpu_memory_usage
        if t > 0:
            rows.append((evt.key, t / 1e3 / n, evt.count // n, max(mem, 0) / 2**20 / n))
    df = pd.DataFrame(rows, columns=["name", "time (ms)", "calls", "memory (MiB)"])
    total = df["time (ms)"].sum()
    df["share (%)"] = 100 * df["time (ms)"] / total if total else 0.0
    df = df.sort_values("time (ms)", ascending=False).head(top).reset_index(drop=True)
    df["name"] = df["name"].map(_short)
    return df[["name", "time (ms)", "share (%)", "calls", "memory (MiB)"]].round(3)


def stacked(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Several tables of the same columns one under the other, each under its title (for
    example eager, then compiled): as narrow as one table, so it fits the page."""
    return pd.concat({title: t.reset_index(drop=True) for title, t in tables.items()})


def generated_kernels(fn, *args) -> list[str]:
    """Names of the kernels inductor generates when compiling ``fn(*args)`` from
    scratch.

    Inductor names a fused kernel after the operations it fused (for example
    ``triton_red_fused_linalg_vector_norm_sub_0`` on a GPU, ``cpp_fused_...`` on the
    CPU).
    """
    import re

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    _, sources = run_and_get_code(torch.compile(fn), *args)
    names = re.findall(r"\b((?:triton|cpp)_\w*fused\w*)\b", "\n".join(sources))
    return list(dict.fromkeys(names))


def graphs_and_breaks(fn, *args) -> tuple[int, int]:
    """How many graphs ``torch.compile`` makes of ``fn(*args)``, and how many graph
    breaks split them (chapters 2, 3, 6 and 8), as ``torch._dynamo.explain`` reports
    them (PyTorch's diagnostic for graph breaks)."""
    explanation = torch._dynamo.explain(fn)(*args)
    return explanation.graph_count, explanation.graph_break_count


def compiler_count(group: str, name: str) -> int:
    """``torch._dynamo``'s counter ``name`` of ``group`` (``"stats"``: compiled graphs,
    ``"inductor"``: CUDA graph skips, ...), since the last :func:`reset_compiler`."""
    return int(torch._dynamo.utils.counters[group][name])


def reset_compiler() -> None:
    """Forget every compiled graph and zero ``torch._dynamo``'s counters."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def break_reasons(fn, *args, lines: int = 4, width: int = 88) -> list[str]:
    """The distinct reasons ``torch._dynamo.explain`` gives for the graph breaks of
    ``fn(*args)`` (chapter 3): each one's first ``lines`` lines, whole, wrapped at
    ``width`` characters (continuations indented), so that no word is cut."""
    explanation = torch._dynamo.explain(fn)(*args)
    reasons = dict.fromkeys(str(b.reason).strip() for b in explanation.break_reasons)
    return [
        "\n".join(
            textwrap.fill(line, width, subsequent_indent="    ", break_long_words=False)
            for line in r.splitlines()[:lines]
        )
        for r in reasons
    ]


_SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMalloc",
    "cudaFree",
)


# Runtime calls during which the host waits for the device (cudaFree synchronises it
# too).
_WAITS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaFree",
)


def runtime_calls(prof, names: tuple[str, ...] = _SYNC_CALLS) -> pd.DataFrame:
    """CUDA runtime calls that make the host wait (or allocate), per iteration.

    Returns:
        DataFrame with ``name``, ``calls``, ``host time (ms)``, one row per runtime
        function whose name starts with one of ``names`` (empty on the CPU).
    """
    n = getattr(prof, "n_iters", 1)
    rows = [
        (e.key, e.count / n, e.cpu_time_total / 1e3 / n)
        for e in prof.key_averages()
        if e.key.startswith(names)
    ]
    df = pd.DataFrame(rows, columns=["name", "calls", "host time (ms)"])
    return (
        df.sort_values("host time (ms)", ascending=False)
        .reset_index(drop=True)
        .round(3)
    )


def timeline(prof) -> pd.DataFrame:
    """Device kernels and host synchronisations of a GPU profile, on one time axis.

    Returns:
        DataFrame with ``lane`` (``GPU kernels`` or ``host waits``), ``name``,
        ``start_ms`` and ``end_ms`` relative to the first event.
    """
    rows = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            lane = "GPU kernels"
        elif e.name.startswith(_WAITS):
            lane = "host waits"
        else:
            continue
        rows.append((lane, e.name, e.time_range.start / 1e3, e.time_range.end / 1e3))
    df = pd.DataFrame(rows, columns=["lane", "name", "start_ms", "end_ms"])
    if len(df):
        t0 = df["start_ms"].min()
        df[["start_ms", "end_ms"]] -= t0
    return df.sort_values("start_ms").reset_index(drop=True)


def gpu_busy_fraction(tl: pd.DataFrame) -> float:
    """Fraction of the span of a :func:`timeline` during which at least one kernel
    runs."""
    k = tl[tl["lane"] == "GPU kernels"].sort_values("start_ms")
    if k.empty:
        return float("nan")
    busy, end = 0.0, -float("inf")
    for s, e in zip(k["start_ms"], k["end_ms"], strict=True):
        if s > end:
            busy += e - s
        elif e > end:
            busy += e - end
        end = max(end, e)
    return busy / (k["end_ms"].max() - k["start_ms"].min())


def kernels_per_iteration(prof) -> float:
    """Number of device kernels (and memsets/copies) launched per profiled iteration."""
    n = getattr(prof, "n_iters", 1)
    return (
        sum(e.count for e in prof.key_averages() if e.device_type == DeviceType.CUDA)
        / n
    )
