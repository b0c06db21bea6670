"""The book's timing protocol (chapter 1), shared by every chapter and the benchmark
command.

Protocol (the one the anchor tutorial publishes, so numbers compare): ``n_warmup``
iterations of a forward pass plus a training step, then ``n_iters`` timed forward passes
under ``torch.no_grad()`` and ``n_iters`` timed training steps (zero_grad, forward, mean
squared error against the target, backward, Adam step). Every call recomputes the
neighbours. The warm-up runs with every input check; the timed iterations skip the
checks of tensor *values* (finite coordinates), which need a host synchronisation each,
so that timings measure the computation. Timing goes through
:class:`torch.utils.benchmark.Timer`, which synchronises the device around the timed
block; results are milliseconds per iteration. :func:`crossover` reads two measured
curves: the size from which one stays below the other (chapters 12 and 13).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import pandas as pd
import torch
from torch.utils import benchmark

from .graphs import CapturedStep, captured_forward, captured_train_step
from .ops.checks import value_checks
from .training import make_forward, make_train_step

__all__ = [
    "Timing",
    "crossover",
    "make_forward",
    "make_train_step",
    "time_fn",
    "time_blocks",
    "time_within_budget",
    "runs_table",
    "device_quantiles",
    "time_projector",
    "first_call_seconds",
    "peak_memory_mb",
    "timings_frame",
    "summary",
    "compare",
    "above_floor",
    "forward_peak_mb",
]


@dataclass
class Timing:
    """One row of a timing table."""

    variant: str
    forward_ms: float
    train_ms: float
    peak_mb: float
    hardware: str
    n_ref: int
    n_query: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], n_iters: int) -> float:
    """Milliseconds per call of ``fn``, over one block of ``n_iters`` calls (after 2
    warm-ups)."""
    timer = benchmark.Timer(
        stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
    )
    return timer.timeit(n_iters).mean * 1e3


def time_blocks(
    fn: Callable[[], object], n_iters: int, repeats: int = 5
) -> tuple[float, float, float]:
    """Milliseconds per call of ``fn`` over ``repeats`` blocks of ``n_iters`` calls
    (:func:`time_fn` each): the median block, the fastest and the slowest."""
    times = sorted(time_fn(fn, n_iters) for _ in range(repeats))
    return times[len(times) // 2], times[0], times[-1]


def time_within_budget(
    fn: Callable[[], object],
    budget_ms: float,
    most: int,
    repeats: int = 3,
) -> tuple[float, float, float, int]:
    """:func:`time_blocks` of ``fn`` in blocks about ``budget_ms`` long (at least one
    call, at most ``most``), after a first call with every input check, as a first call
    runs; the timed calls skip the value checks, as in every chapter. Returns the median
    block, the fastest, the slowest and the calls per block."""
    once = time_fn(fn, 1)
    n_iters = max(1, min(most, int(budget_ms / max(once, 1e-3))))
    with value_checks(False):
        ms, lo, hi = time_blocks(fn, n_iters, repeats=repeats)
    return ms, lo, hi, n_iters


def runs_table(rows: list[dict], keys: list[str], value: str = "ms") -> pd.DataFrame:
    """One row per ``keys``, in the order first met: the median of the runs' ``value``,
    their fastest and slowest, and the number of runs."""
    g = pd.DataFrame(rows).groupby(keys, sort=False)[value]
    return pd.DataFrame(
        {value: g.median(), "min": g.min(), "max": g.max(), "runs": g.size()}
    )


def device_quantiles(
    fn: Callable[[], object], quantiles: tuple[float, ...] = (0.2, 0.5, 0.8)
) -> list[float]:
    """Milliseconds of ``fn``'s kernels on the device at ``quantiles``: Triton's
    ``do_bench`` (the L2 cache emptied before each call) of ``fn`` captured in a CUDA
    graph and replayed, so that no Python runs between its events and a host slow to
    launch never counts as device time. ``fn`` must be capturable (fixed inputs)."""
    from triton.testing import do_bench

    return do_bench(CapturedStep(fn), quantiles=list(quantiles))


def peak_memory_mb(fn: Callable[[], object], device: torch.device) -> float:
    """Peak memory allocated by PyTorch while ``fn`` runs once, in MiB (2**20 bytes; NaN
    on the CPU, or where PyTorch's allocator is replaced and keeps no statistics)."""
    if device.type != "cuda":
        return math.nan
    try:
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device)
    except RuntimeError:
        return math.nan
    return peak / 2**20 if peak else math.nan


def first_call_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of one call, synchronised: for a compiled function's first
    call this is dominated by compilation."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def time_projector(
    model: torch.nn.Module,
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
    target: torch.Tensor,
    *,
    n_warmup: int,
    n_iters: int,
    params=None,
    graphs: bool = False,
    train: bool = True,
) -> dict[str, float]:
    """Time a projector by the book's protocol.

    Args:
        model: the projector, eager or compiled.
        p_query: ``(M, 3)``; p_ref: ``(N, 3)``; target: ``(M, 1)``.
        params: the parameters to train (default: ``model.parameters()``).
        graphs: time replays of the forward pass and of the training step, each captured
            in a CUDA graph after the warm-up (:mod:`extkernels.graphs`); every replay
            recomputes everything, neighbours included.
        train: time the training step too; without it (a packaged model, which has
            no backward: chapter 15) ``train_ms`` is NaN and ``peak_mb`` is the
            forward pass's.

    Returns:
        ``forward_ms`` and ``train_ms`` per iteration, and ``peak_mb`` of one training
        step.
    """
    params = params if params is not None else model.parameters()
    if graphs:
        forward = captured_forward(model, p_query, p_ref, warmup=n_warmup)
        step = (
            captured_train_step(model, params, p_query, p_ref, target, warmup=n_warmup)
            if train
            else None
        )
    else:
        forward = make_forward(model, p_query, p_ref)
        step = make_train_step(model, params, p_query, p_ref, target) if train else None
        for _ in range(n_warmup):
            forward()
            if step is not None:
                step()
    # The warm-up validated the inputs; the timed iterations measure the computation
    # alone, without the host synchronisations that checking values for NaN costs
    # (chapter 7).
    with value_checks(False):
        return {
            "forward_ms": time_fn(forward, n_iters),
            "train_ms": math.nan if step is None else time_fn(step, n_iters),
            "peak_mb": peak_memory_mb(step or forward, p_ref.device),
        }


def timings_frame(
    rows: list[Timing | dict], baseline: str | None = None
) -> pd.DataFrame:
    """Timing rows as a DataFrame indexed by variant: one row per variant, however many
    runs.

    Several rows of one variant (repeated runs, each in a fresh process) become their
    median, with the spread beside it: ``forward_min``/``forward_max`` and
    ``train_min``/``train_max`` (equal to the median for a single run), and ``repeats``.
    ``first_call_s`` is the first run's that has one (later runs may reuse the
    compiler's caches and report none). Speedups over ``baseline`` are ratios of
    medians.
    """
    df = pd.DataFrame([asdict(r) if isinstance(r, Timing) else r for r in rows])
    runs = df.groupby("variant", sort=False)
    out = runs.first()  # the non-numeric columns (hardware, workload) and first_call_s
    numeric = [
        c for c in df.columns if c != "variant" and pd.api.types.is_numeric_dtype(df[c])
    ]
    medians = runs[[c for c in numeric if c != "first_call_s"]].median()
    out[medians.columns] = medians
    for metric in ("forward", "train"):
        out[f"{metric}_min"] = runs[f"{metric}_ms"].min()
        out[f"{metric}_max"] = runs[f"{metric}_ms"].max()
    out["repeats"] = runs.size()
    if baseline is not None and baseline in out.index:
        out["forward_speedup"] = out.loc[baseline, "forward_ms"] / out["forward_ms"]
        out["train_speedup"] = out.loc[baseline, "train_ms"] / out["train_ms"]
    return out


def summary(df: pd.DataFrame, digits: int = 3) -> pd.DataFrame:
    """A timing table as the chapters show it: forward and training ms as ``median
    (min–max)`` of the runs, speedups where the frame has them, peak memory in MiB, and
    the first call's seconds where there is one. Few columns, so it fits the page.

    Args:
        df: from :func:`timings_frame` (or :func:`extkernels.benchmark.run_all`).
    """

    def median_and_range(metric: str) -> list[str]:
        cols = (f"{metric}_ms", f"{metric}_min", f"{metric}_max")
        return [
            f"{m:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})" if m == m else "–"
            for m, lo, hi in df[list(cols)].values
        ]  # "–": not timed (a packaged model has no training step)

    out = pd.DataFrame(
        {
            "forward ms": median_and_range("forward"),
            "training ms": median_and_range("train"),
        },
        index=df.index,
    )
    if "forward_speedup" in df:
        out["× eager fwd"] = df["forward_speedup"].round(1)
        out["× eager train"] = df["train_speedup"].round(1)
    # no figure where PyTorch's allocator is not the one used (RMM's pool, chapter 4;
    # a CPU): "n/a", not NaN
    out["peak MiB"] = [
        "n/a" if v != v else f"{v:.0f}" for v in df["peak_mb"].to_numpy()
    ]
    if "first_call_s" in df and df["first_call_s"].notna().any():
        out["first call s"] = df["first_call_s"].round(1)
    return out.rename_axis("variant")


def compare(
    df: pd.DataFrame, pairs: dict[str, tuple[str, str]], metric: str = "train"
) -> pd.DataFrame:
    """Numbers for comparing variants, no words: for each ``label -> (a, b)``, both
    medians of ``metric`` (``forward`` or ``train``) with their runs' range, the ratio
    of the medians ``a / b`` (below 1: ``a`` took less time), and whether the two
    ranges overlap. The page's sentence, written by a person, reads these.

    Args:
        df: from :func:`timings_frame`, one host's runs.
        pairs: label -> (variant a, variant b), both rows of ``df``.
        metric: ``"forward"`` or ``"train"``.
    """
    if metric not in ("forward", "train"):
        raise ValueError(f"metric must be 'forward' or 'train', got {metric!r}")
    med, lo, hi = f"{metric}_ms", f"{metric}_min", f"{metric}_max"
    rows = {}
    for label, (a, b) in pairs.items():
        for name in (a, b):
            if name not in df.index:
                raise KeyError(f"variant {name!r} is not in the table")
        ra, rb = df.loc[a], df.loc[b]
        rows[label] = {
            "a": a,
            "b": b,
            "a ms": ra[med],
            "a range": f"{ra[lo]:.3f}–{ra[hi]:.3f}",
            "b ms": rb[med],
            "b range": f"{rb[lo]:.3f}–{rb[hi]:.3f}",
            "a / b": ra[med] / rb[med],
            "ranges overlap": bool(ra[lo] <= rb[hi] and rb[lo] <= ra[hi]),
        }
    return pd.DataFrame(rows).T.rename_axis("comparison")


def above_floor(df: pd.DataFrame, pairs: dict[str, tuple[str, str]]) -> pd.DataFrame:
    """What a projector's aggregation adds to a floor variant (the same projector with
    :class:`~extkernels.models.FixedGather` instead, chapter 7): for each ``label ->
    (variant, floor variant)`` and each of forward and training, both medians and
    their difference.

    Returns:
        DataFrame indexed by ``(label, "forward" | "training")`` with ``projector ms``,
        ``floor ms`` and ``aggregation ms``.
    """
    rows = {
        (label, metric): {
            "projector ms": df.loc[name, f"{key}_ms"],
            "floor ms": df.loc[floor, f"{key}_ms"],
        }
        for label, (name, floor) in pairs.items()
        for metric, key in (("forward", "forward"), ("training", "train"))
    }
    out = pd.DataFrame(rows).T
    out["aggregation ms"] = out["projector ms"] - out["floor ms"]
    return out


def crossover(df: pd.DataFrame, a: str, b: str, x: str, y: str = "ms") -> float:
    """The smallest ``x`` from which backend ``a`` is faster than ``b`` at every larger
    ``x`` measured for both (``a``'s slowest block below ``b``'s fastest); NaN when it
    never is, and the smallest ``x`` when it always is."""
    ok = df[df["status"] == "ok"]
    pa = ok[ok["backend"] == a].set_index(x)
    pb = ok[ok["backend"] == b].set_index(x)
    common = sorted(set(pa.index) & set(pb.index))
    found = math.nan
    for value in reversed(common):
        if pa.loc[value, "max"] < pb.loc[value, "min"]:
            found = value
        else:
            break
    return float(found)


def forward_peak_mb(model, p_query: torch.Tensor, p_ref: torch.Tensor) -> float:
    """Peak memory of one forward pass under ``torch.no_grad()``, in MiB (NaN on the
    CPU)."""

    return peak_memory_mb(make_forward(model, p_query, p_ref), p_ref.device)
