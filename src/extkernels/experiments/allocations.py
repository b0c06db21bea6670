"""The CUDA runtime calls behind a training step's allocations, by memory pool (chapter
4's experiment): ``cudaMalloc`` and ``cudaFree``, and the synchronising calls that a
removed ``cudaFree`` hands its wait to.

The step is the benchmark's ``knn/cuml-op+compile``: the projector with cuML's search
as a custom operator, compiled with ``fullgraph=True``. PyTorch's allocator is chosen
once per process, so each measurement runs in a fresh one::

    python -m extkernels.experiments.allocations --pool none --json out.json
    python -m extkernels.experiments.allocations --pool rapids --json out.json
    python -m extkernels.experiments.allocations --pool shared --json out.json

:func:`calls_in_fresh_process` runs :func:`allocation_calls` so from the chapter
(:func:`extkernels.fresh.call`); :func:`timing_numbers` and :func:`call_numbers` pick
the figures that chapter 4's prose quotes.
"""

from __future__ import annotations

import argparse
import json

import pandas as pd
import torch

from .. import fresh
from ..data import query_grid, reference_cloud, targets
from ..memory import use_rmm_pool
from ..models import KnnAggregation, Projector
from ..problem import problem
from ..profiling import profile, runtime_calls
from ..training import make_train_step

__all__ = [
    "allocation_calls",
    "call_numbers",
    "allocation_rows",
    "calls_in_fresh_process",
    "main",
    "projector",
    "timing_numbers",
]


#: ``none``: PyTorch's caching allocator and RMM's default (no pool) for cuML and
#: CuPy; ``rapids``: an RMM pool for cuML and CuPy only; ``shared``: one RMM pool for
#: all three.
POOLS = ("none", "rapids", "shared")
CALLS = ("cudaMalloc", "cudaFree", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def projector(backend: str, prob) -> tuple[torch.nn.Module, tuple]:
    """The kNN projector with ``backend``'s aggregation and its data at ``prob``'s
    sizes, built as the benchmark builds its variants: ``(model, (p_query, p_ref,
    target))``."""
    p_ref = reference_cloud(prob.n_ref, seed=prob.seed, device=prob.device)
    p_query = query_grid(prob.grid_side, device=prob.device)
    target = targets(p_query.shape[0], seed=prob.seed, device=prob.device)
    agg = KnnAggregation(prob.k, prob.sigma, backend)
    torch.manual_seed(prob.seed)
    return Projector(agg, prob.hidden).to(prob.device), (p_query, p_ref, target)


def allocation_calls(backend: str = "cuml", *, pool: str, n_iters: int = 5):
    """The calls of :data:`CALLS` per training step of the compiled kNN projector with
    ``backend``'s aggregation (cuML's: ``knn/cuml-op+compile``), with the given pool.

    Must run in a fresh process (see :func:`calls_in_fresh_process`), since the
    allocator is chosen once.

    Returns:
        DataFrame of :func:`extkernels.profiling.runtime_calls` restricted to those
        calls.
    """
    if pool not in POOLS:
        raise ValueError(f"pool: expected one of {POOLS}, got {pool!r}")
    if pool != "none":
        use_rmm_pool(pytorch=pool == "shared")
    prob = problem()
    model, data = projector(backend, prob)
    run_model = torch.compile(model, fullgraph=True)
    step = make_train_step(run_model, model.parameters(), *data)
    prof = profile(step, device=prob.device, n_iters=n_iters, warmup=3)
    names = list(CALLS)
    calls = runtime_calls(prof, names=CALLS).set_index("name")
    # A call that never happened is a row of zeros, not a missing row.
    order = names + sorted(set(calls.index) - set(names))
    return calls.reindex(order, fill_value=0.0).reset_index()


def allocation_rows(pool: str, backend: str = "cuml") -> list[dict]:
    """:func:`allocation_calls` as JSON records, what a fresh process sends back."""
    return json.loads(allocation_calls(backend, pool=pool).to_json(orient="records"))


def calls_in_fresh_process(pool: str, backend: str = "cuml") -> pd.DataFrame:
    """:func:`allocation_calls` for ``pool``, run in a fresh Python process (chapter
    4).

    Returns:
        DataFrame indexed by runtime call name, with ``calls`` and ``host time (ms)``
        per training step.
    """
    if pool not in POOLS:
        raise ValueError(f"pool: expected one of {POOLS}, got {pool!r}")
    rows = fresh.call(
        "extkernels.experiments.allocations", "allocation_rows", pool, backend
    )
    return pd.DataFrame(rows).set_index("name")


def timing_numbers(
    table: pd.DataFrame, none: str, rapids: str, shared: str
) -> dict[str, float]:
    """The numbers chapter 4's prose quotes from its timing table, by glue key.

    Args:
        table: from :func:`extkernels.benchmark.run_all`.
        none, rapids, shared: the variants timed without a pool, with a pool for RAPIDS
            only, and with one pool shared with PyTorch.

    Returns:
        the shared pool's forward milliseconds, the gains of both pools over none
        (ratios of medians) and the milliseconds a training step saves.
    """
    n, r, s = table.loc[none], table.loc[rapids], table.loc[shared]
    return {
        "rmm_fwd_ms": float(s["forward_ms"]),
        "rmm_fwd_gain": float(n["forward_ms"] / s["forward_ms"]),
        "rmm_train_gain": float(n["train_ms"] / s["train_ms"]),
        "rapids_fwd_gain": float(n["forward_ms"] / r["forward_ms"]),
        "saved_step_ms": float(n["train_ms"] - s["train_ms"]),
    }


def call_numbers(calls: pd.DataFrame) -> dict[str, float]:
    """The numbers chapter 4's prose quotes from its table of runtime calls, by glue
    key: ``cudaFree`` calls and host time per step without a pool, and the host time
    of ``cudaStreamSynchronize`` without a pool and with the shared one.

    Args:
        calls: indexed by (pool, call name), with ``calls`` and ``host time (ms)``
            (:func:`calls_in_fresh_process` per pool, concatenated).
    """
    host = calls["host time (ms)"]
    return {
        "free_calls": float(calls.loc[("none", "cudaFree"), "calls"]),
        "free_ms": float(host[("none", "cudaFree")]),
        "sync_none_ms": float(host[("none", "cudaStreamSynchronize")]),
        "sync_shared_ms": float(host[("shared", "cudaStreamSynchronize")]),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m extkernels.experiments.allocations --pool POOL --json out.json``."""
    ap = argparse.ArgumentParser(prog="python -m extkernels.experiments.allocations")
    ap.add_argument(
        "--pool", choices=POOLS, default="none", help="which RMM pool to install"
    )
    ap.add_argument("--backend", default="cuml", help="the kNN aggregation's backend")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    allocation_calls(args.backend, pool=args.pool).to_json(args.json, orient="records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
