"""The scaling study of chapter 12: each backend's aggregation timed against the
number of reference points and of queries, with its peak memory, and the slope of each
curve on log-log axes.

A curve stops where the backend runs out of memory or where one call takes longer than
``budget_s``: the brute force, whose memory and time grow as N x M, stops first.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from ..data import features, query_grid, reference_cloud
from ..ops import knn_aggregate, radius_aggregate
from ..ops.checks import value_checks
from ..timing import peak_memory_mb, ranked, time_blocks, time_fn

__all__ = ["sweep", "slopes", "crossover", "value_at", "compare_at", "pays_from"]


def _call(op: str, backend: str, p_query, p_ref, feats, *, k, sigma, radius):
    if op == "knn_aggregate":
        return lambda: knn_aggregate(p_query, p_ref, feats, k, sigma, backend=backend)
    if op == "radius_aggregate":
        return lambda: radius_aggregate(
            p_query, p_ref, feats, radius, sigma, backend=backend
        )
    raise ValueError(f"op: expected knn_aggregate or radius_aggregate, got {op!r}")


def sweep(
    op: str,
    backends: list[str],
    sizes: list[tuple[int, int]],
    *,
    k: int = 7,
    sigma: float = 0.1,
    radius: float = 0.1,
    hidden: int = 25,
    device: torch.device | str = "cpu",
    repeats: int = 5,
    budget_s: float = 1.0,
) -> pd.DataFrame:
    """Time ``op`` (``knn_aggregate`` or ``radius_aggregate``, forward under
    ``no_grad``) by each backend at each ``(n_ref, grid_side)`` of ``sizes``: a cloud of
    ``n_ref`` points and a query grid of ``grid_side``³ points.

    Each point is the median of ``repeats`` blocks of calls (each block about 50 ms of
    calls, at least one), with the blocks' range; a backend's curve stops after the
    first size that runs out of memory or takes more than ``budget_s`` per call.

    Returns:
        DataFrame with ``backend``, ``n_ref``, ``n_query``, ``ms``, ``min``, ``max``,
        ``peak MiB`` and ``status`` (``ok``, ``out of memory`` or ``not run``).
    """
    device = torch.device(device)
    rows = []
    for backend in backends:
        stopped = None
        for n_ref, side in sizes:
            row = {"backend": backend, "n_ref": n_ref, "n_query": side**3}
            if stopped:
                rows.append({**row, "status": f"not run ({stopped})"})
                continue
            try:
                p_ref = reference_cloud(n_ref, seed=0, device=device)
                p_query = query_grid(side, device=device)
                feats = features(n_ref, hidden, seed=0, device=device)
                fn = _call(
                    op, backend, p_query, p_ref, feats, k=k, sigma=sigma, radius=radius
                )
                with torch.no_grad(), value_checks(False):
                    once = time_fn(fn, 1)
                    n_iters = max(1, min(200, int(50 / max(once, 1e-3))))
                    ms, fastest, slowest = time_blocks(fn, n_iters, repeats)
                    peak = peak_memory_mb(fn, device)
                row.update(ms=ms, min=fastest, max=slowest, status="ok")
                row["peak MiB"] = peak
                if fastest > 1e3 * budget_s:
                    stopped = f"over {budget_s:g} s per call"
            except torch.OutOfMemoryError:
                row["status"] = "out of memory"
                stopped = "out of memory"
            finally:
                p_ref = p_query = feats = fn = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
    columns = ["backend", "n_ref", "n_query", "ms", "min", "max", "peak MiB", "status"]
    return pd.DataFrame(rows).reindex(columns=columns)


def slopes(
    df: pd.DataFrame,
    x: str,
    y: str = "ms",
    *,
    by: str = "backend",
    tail: int | None = None,
):
    """The slope of ``log y`` against ``log x`` for each ``by``, by least squares over
    the rows measured (``status == "ok"``): time grows as ``x ** slope``. With ``tail``,
    over the ``tail`` largest ``x`` measured only, where the work outgrows the fixed
    costs of a call.

    Returns:
        Series indexed by ``by`` (NaN where fewer than two points were measured).
    """
    out = {}
    for name, part in df[df["status"] == "ok"].groupby(by, sort=False):
        if tail is not None:
            part = part.nlargest(tail, x)
        if part[x].nunique() < 2:
            out[name] = math.nan
            continue
        slope, _ = np.polyfit(np.log10(part[x]), np.log10(part[y]), 1)
        out[name] = float(slope)
    return pd.Series(out, name=f"slope of {y} vs {x}")


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


def _x(against: str) -> str:
    return "n_ref" if against == "N" else "n_query"


def value_at(
    sweeps: dict, workload: str, against: str, size: int, backend: str, column="ms"
) -> float:
    """One measurement of the sweeps (``{(workload, against): sweep table}``): the
    ``column`` (``ms``, ``min`` or ``max``) of ``backend`` at ``size``."""
    df = sweeps[(workload, against)]
    row = df[(df[_x(against)] == size) & (df["backend"] == backend)]
    return float(row[column].iloc[0])


def compare_at(
    sweeps: dict, workload: str, against: str, size: int, a: str, b: str
) -> str:
    """``a`` against ``b`` at ``size``, in words (:func:`~extkernels.timing.ranked`
    of the two spreads): "faster than", "slower than" or "within the spread of"."""
    spread = [
        tuple(value_at(sweeps, workload, against, size, n, c) for c in ("min", "max"))
        for n in (a, b)
    ]
    return ranked(*spread, same="within the spread of")


def pays_from(sweeps: dict, baseline: str = "torch") -> pd.DataFrame:
    """Where each backend starts to beat ``baseline`` in every sweep
    (:func:`crossover`): the size, "always" from the smallest, "never", or empty
    where the backend was not swept."""
    columns = {}
    for (workload, against), df in sweeps.items():
        x, smallest = _x(against), df[_x(against)].min()
        out = {}
        for backend in df["backend"].unique():
            if backend == baseline:
                continue
            at = crossover(df, backend, baseline, x)
            out[backend] = (
                "never" if at != at else ("always" if at == smallest else f"{at:,.0f}")
            )
        columns[f"{workload} vs {against}"] = pd.Series(out)
    return pd.DataFrame(columns).fillna("")
