"""The scaling study of chapter 12: each backend's aggregation timed against the
number of reference points and of queries, with its peak memory, and the slope of each
curve on log-log axes.

A curve stops where the backend runs out of memory or where one call takes longer than
``budget_s``: the brute force, whose memory and time grow as N x M, stops first.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from ..data import features, query_grid, reference_cloud
from ..ops import knn_aggregate, radius_aggregate
from ..ops.checks import value_checks
from ..plotting import scaling_plot
from ..results import variant_quotes
from ..timing import crossover, peak_memory_mb, time_blocks, time_fn

__all__ = [
    "AXES",
    "crossover",
    "memory_panels",
    "memory_table",
    "readable",
    "pays_from",
    "size_column",
    "size_quotes",
    "slope_quotes",
    "slopes",
    "stop_quotes",
    "stops",
    "sweep",
    "sweep_panels",
    "time_table",
    "value_at",
    "variant_quotes",
]

#: The sweep tables' size columns, in the words a reader sees on the page.
AXES = {"n_ref": "points N", "n_query": "queries M"}


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


def size_column(against: str) -> str:
    """The sweep table's column that a sweep ``against`` ``"N"`` (reference points) or
    ``"M"`` (queries) varies (chapter 12): ``n_ref`` or ``n_query``."""
    return "n_ref" if against == "N" else "n_query"


def value_at(
    sweeps: dict, workload: str, against: str, size: int, backend: str, column="ms"
) -> float:
    """One measurement of the sweeps (``{(workload, against): sweep table}``): the
    ``column`` (``ms``, ``min`` or ``max``) of ``backend`` at ``size``."""
    df = sweeps[(workload, against)]
    row = df[(df[size_column(against)] == size) & (df["backend"] == backend)]
    return float(row[column].iloc[0])


def pays_from(sweeps: dict, baseline: str = "torch") -> pd.DataFrame:
    """Where each backend starts to beat ``baseline`` in every sweep
    (:func:`crossover`): the size, "always" from the smallest, "never", or empty
    where the backend was not swept."""
    columns = {}
    for (workload, against), df in sweeps.items():
        x, smallest = size_column(against), df[size_column(against)].min()
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


# ---- what chapter 12 shows and quotes ---------------------------------------------


def size_quotes(sweeps: dict) -> dict[str, float | str]:
    """The numbers chapter 12 quotes at the largest sizes swept: the largest N and M
    (as text with thousands separators), the fused and C++ searches' milliseconds
    there, Warp's radius time and cuML's time over the fused search's, where those
    backends were swept."""
    n_big = int(sweeps[("kNN", "N")]["n_ref"].max())
    m_big = int(sweeps[("kNN", "M")]["n_query"].max())
    out = {"n_big": f"{n_big:,}", "m_big": f"{m_big:,}"}
    out["fused_knn_n_big"] = value_at(sweeps, "kNN", "N", n_big, "fused")
    out["fused_radius_n_big"] = value_at(sweeps, "radius", "N", n_big, "fused")
    out["cpp_knn_m_big"] = value_at(sweeps, "kNN", "M", m_big, "cpp")
    out["fused_knn_m_big"] = value_at(sweeps, "kNN", "M", m_big, "fused")
    if "warp" in set(sweeps[("radius", "N")]["backend"]):
        out["warp_radius_n_big"] = value_at(sweeps, "radius", "N", n_big, "warp")
    if "cuml" in set(sweeps[("kNN", "N")]["backend"]):
        cuml = value_at(sweeps, "kNN", "N", n_big, "cuml")
        out["cuml_over_fused_n_big"] = cuml / value_at(
            sweeps, "kNN", "N", n_big, "fused"
        )
    return out


def time_table(measured: pd.DataFrame, digits: int = 3) -> pd.DataFrame:
    """Chapter 12's table of every sweep (``measured``: the sweeps concatenated under
    the index levels ``workload`` and ``against``), as a reader reads it: a row per
    (workload, against, size), a column per backend in the order they were swept; each
    cell the ms per call to ``digits`` decimals, why the sweep stopped where it did (for
    example ``"out of memory"``), or ``"–"`` where the backend does not run the
    workload."""
    times = measured.reset_index()
    times["size"] = times["n_ref"].where(times["against"] == "N", times["n_query"])
    times["cell"] = [
        f"{ms:.{digits}f}" if status == "ok" else status
        for ms, status in zip(times["ms"], times["status"], strict=True)
    ]
    backends = list(dict.fromkeys(times["backend"]))
    table = times.pivot_table(
        index=["workload", "against", "size"],
        columns="backend",
        values="cell",
        aggfunc="first",
    )[backends]
    # the unit over the backends' columns, where the header has room for it
    return table.fillna("–").rename_axis(columns="ms per call")


def slope_quotes(slopes: pd.DataFrame) -> dict[str, float]:
    """Chapter 12's slopes (a column per ``"<workload> vs <N or M>"``, a row per
    backend) under the names the prose quotes: ``slope_knn_vs_N_torch`` and so on."""
    out = {}
    for column in slopes:
        for backend, value in slopes[column].dropna().items():
            key = column.replace(" ", "_").replace("kNN", "knn")
            out[f"slope_{key}_{backend}"] = float(value)
    return out


def sweep_panels(sweeps: dict, *, hardware: str):
    """Chapter 12's four panels: ms per call of each backend against N and against M,
    for each workload, on log-log axes (the sizes measured, ``status == "ok"``).

    Returns:
        The matplotlib figure.
    """
    # the book's column is about 7.5 inches at 100 dpi: drawn at that width, the fonts
    # keep their size on the page
    fig, axes = plt.subplots(2, 2, figsize=(7.6, 7.4))
    for ax, ((workload, against), df) in zip(axes.flat, sweeps.items(), strict=True):
        fixed = (
            f"{df['n_query'].iloc[0]:,} queries"
            if against == "N"
            else f"{df['n_ref'].iloc[0]:,} points"
        )
        scaling_plot(
            df[df["status"] == "ok"].rename(columns=AXES),
            x=AXES[size_column(against)],
            y="ms",
            by="backend",
            title=f"{workload} aggregation against {against} ({fixed})",
            hardware=hardware,
            ylabel="ms per call",
            ax=ax,
        )
    return fig


def _memory(measured: pd.DataFrame) -> pd.DataFrame:
    memory = measured.reset_index()
    memory = memory[(memory["against"] == "N") & (memory["status"] == "ok")]
    return memory.rename(columns=AXES)


def memory_panels(measured: pd.DataFrame, *, hardware: str):
    """Chapter 12's peak memory of each backend against N, a panel per workload
    (``measured``: the sweeps concatenated, as for :func:`time_table`).

    Returns:
        The matplotlib figure.
    """
    memory = _memory(measured)
    fig, axes = plt.subplots(1, 2, figsize=(7.6, 3.9))
    for ax, workload in zip(axes, ("kNN", "radius"), strict=True):
        scaling_plot(
            memory[memory["workload"] == workload],
            x="points N",
            y="peak MiB",
            by="backend",
            title=f"{workload}: peak memory against N",
            hardware=hardware,
            ylabel="peak MiB",
            ax=ax,
        )
    return fig


def readable(table: pd.DataFrame, decimals: int) -> pd.DataFrame:
    """``table`` as a page shows it: each number with ``decimals`` places and its
    thousands separated, ``"–"`` where there is none (a backend without that workload,
    or a curve that stopped before that size)."""
    return table.map(lambda v: "–" if pd.isna(v) else f"{v:,.{decimals}f}")


def memory_table(measured: pd.DataFrame) -> pd.DataFrame:
    """Chapter 12's peak MiB against N: a row per (workload, points N), a column per
    backend, in whole MiB (:func:`readable`)."""
    table = _memory(measured).pivot_table(
        index=["workload", "points N"], columns="backend", values="peak MiB"
    )
    return readable(table, 0).rename_axis(columns="peak MiB")


def stops(measured: pd.DataFrame) -> pd.DataFrame:
    """Where a curve of chapter 12's sweeps stopped: the rows whose status is neither
    ``ok`` nor ``not run``, with the workload, the sweep, the backend, the sizes
    (``points N``, ``queries M``) and why."""
    out = measured[~measured["status"].isin(["ok"])].reset_index()
    out = out[~out["status"].str.startswith("not run")]
    out = out[["workload", "against", "backend", "n_ref", "n_query", "status"]]
    return out.rename(columns=AXES)


def stop_quotes(stopped: pd.DataFrame, baseline: str = "torch") -> dict[str, str]:
    """The sizes at which ``baseline``'s curves stopped (:func:`stops`), as text with
    thousands separators, under the names chapter 12 quotes:
    ``torch_stop_knn_N`` and so on."""
    out = {}
    for _, row in stopped[stopped["backend"] == baseline].iterrows():
        key = f"{baseline}_stop_{row['workload'].lower()}_{row['against']}"
        size = row["points N"] if row["against"] == "N" else row["queries M"]
        out[key] = f"{size:,}"
    return out
