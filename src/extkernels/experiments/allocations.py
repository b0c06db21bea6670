"""The CUDA runtime calls behind a training step's allocations, by memory pool (chapter
4's experiment): ``cudaMalloc`` and ``cudaFree``, and the synchronising calls that a
removed ``cudaFree`` hands its wait to.

PyTorch's allocator is chosen once per process, so each measurement runs in a fresh
one::

    python -m extkernels.experiments.allocations --pool none --json out.json
    python -m extkernels.experiments.allocations --pool rapids --json out.json
    python -m extkernels.experiments.allocations --pool shared --json out.json

:func:`calls_in_fresh_process` runs that command from the chapter and reads its table
back; :func:`timing_numbers` and :func:`call_numbers` pick the figures that chapter 4's
prose quotes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from .. import variants
from ..memory import use_rmm_pool
from ..problem import problem
from ..profiling import profile, runtime_calls
from ..training import make_train_step

__all__ = [
    "allocation_calls",
    "call_numbers",
    "calls_in_fresh_process",
    "main",
    "timing_numbers",
]


#: ``none``: PyTorch's caching allocator and RMM's default (no pool) for cuML and
#: CuPy; ``rapids``: an RMM pool for cuML and CuPy only; ``shared``: one RMM pool for
#: all three.
POOLS = ("none", "rapids", "shared")
CALLS = ("cudaMalloc", "cudaFree", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def allocation_calls(
    variant_name: str = "knn/cuml-op+compile", *, pool: str, n_iters: int = 5
):
    """The calls of :data:`CALLS` per training step of a variant, with the given pool.

    Must run in a fresh process (see :func:`main`), since the allocator is chosen once.

    Returns:
        DataFrame of :func:`extkernels.profiling.runtime_calls` restricted to those
        calls.
    """
    if pool not in POOLS:
        raise ValueError(f"pool: expected one of {POOLS}, got {pool!r}")
    if pool != "none":
        use_rmm_pool(pytorch=pool == "shared")
    prob = problem()
    model, run_model, (p_query, p_ref, target) = variants.get(variant_name).build(prob)
    step = make_train_step(run_model, model.parameters(), p_query, p_ref, target)
    prof = profile(step, device=prob.device, n_iters=n_iters, warmup=3)
    names = list(CALLS)
    calls = runtime_calls(prof, names=CALLS).set_index("name")
    # A call that never happened is a row of zeros, not a missing row.
    order = names + sorted(set(calls.index) - set(names))
    return calls.reindex(order, fill_value=0.0).reset_index()


def calls_in_fresh_process(
    pool: str, variant_name: str = "knn/cuml-op+compile"
) -> pd.DataFrame:
    """:func:`allocation_calls` for ``pool``, run in a fresh Python process (chapter
    4): the command of :func:`main`, its table read back.

    Returns:
        DataFrame indexed by runtime call name, with ``calls`` and ``host time (ms)``
        per training step.
    """
    if pool not in POOLS:
        raise ValueError(f"pool: expected one of {POOLS}, got {pool!r}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "calls.json"
        module = "extkernels.experiments.allocations"
        cmd = [sys.executable, "-m", module, "--pool", pool, "--json", str(out)]
        cmd += ["--variant", variant_name]
        subprocess.run(cmd, check=True, capture_output=True)
        return pd.read_json(out).set_index("name")


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
    ap.add_argument("--variant", default="knn/cuml-op+compile")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    allocation_calls(args.variant, pool=args.pool).to_json(args.json, orient="records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
