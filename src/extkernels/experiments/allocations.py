"""How many ``cudaMalloc`` / ``cudaFree`` calls a training step makes, with and without one
RMM pool (chapter 4's experiment).

PyTorch's allocator is chosen once per process, so each measurement runs in a fresh one::

    python -m extkernels.experiments.allocations --json out.json          # default allocators
    python -m extkernels.experiments.allocations --rmm --json out.json    # one RMM pool
"""

from __future__ import annotations

import argparse

from .. import variants
from ..memory import use_rmm_pool
from ..problem import problem
from ..profiling import profile, runtime_calls
from ..training import make_train_step

__all__ = ["allocation_calls", "main"]


def allocation_calls(variant_name: str = "knn/cuml-op+compile", *, rmm: bool, n_iters: int = 5):
    """cudaMalloc / cudaFree calls per training step of a variant, with or without the pool.

    Must run in a fresh process (see :func:`main`), since the allocator is chosen once.

    Returns:
        DataFrame of :func:`extkernels.profiling.runtime_calls` restricted to allocation calls.
    """
    if rmm:
        use_rmm_pool()
    prob = problem()
    model, run_model, (p_query, p_ref, target) = variants.get(variant_name).build(prob)
    step = make_train_step(run_model, model.parameters(), p_query, p_ref, target)
    prof = profile(step, device=prob.device, n_iters=n_iters, warmup=3)
    names = ["cudaMalloc", "cudaFree"]
    calls = runtime_calls(prof, names=tuple(names)).set_index("name")
    # A call that never happened is a row of zeros, not a missing row.
    return calls.reindex(sorted(set(names) | set(calls.index)), fill_value=0.0).reset_index()


def main(argv: list[str] | None = None) -> int:
    """``python -m extkernels.experiments.allocations [--rmm] --json out.json``."""
    ap = argparse.ArgumentParser(prog="python -m extkernels.experiments.allocations")
    ap.add_argument("--rmm", action="store_true", help="install the RMM pool first")
    ap.add_argument("--variant", default="knn/cuml-op+compile")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    allocation_calls(args.variant, rmm=args.rmm).to_json(args.json, orient="records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
