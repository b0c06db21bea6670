"""The CUDA runtime calls behind a training step's allocations, by memory pool (chapter
4's experiment): ``cudaMalloc`` and ``cudaFree``, and the synchronising calls that a
removed ``cudaFree`` hands its wait to.

PyTorch's allocator is chosen once per process, so each measurement runs in a fresh
one::

    python -m extkernels.experiments.allocations --pool none --json out.json
    python -m extkernels.experiments.allocations --pool rapids --json out.json
    python -m extkernels.experiments.allocations --pool shared --json out.json
"""

from __future__ import annotations

import argparse

from .. import variants
from ..memory import use_rmm_pool
from ..problem import problem
from ..profiling import profile, runtime_calls
from ..training import make_train_step

__all__ = ["allocation_calls", "main"]


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
