"""The benchmark command: every variant of the running example, timed by the book's protocol
(chapter 1 introduces it; every chapter's timing tables come from it).

    python -m extkernels.benchmark                    # all variants that run here
    python -m extkernels.benchmark --variants knn/torch,knn/torch+compile --json out.json

Prints one table (forward and training ms per iteration, speedup over the eager brute force of
the same workload, peak memory, first-call seconds) and writes it as JSON with the hardware and
versions. Variants flagged ``isolated`` run in a subprocess of their own. Ratios in the table
come from one run of this command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import pandas as pd

from . import variants as V
from .notebook import versions
from .problem import problem
from .timing import timings_frame

__all__ = ["run_all", "main"]


def _run_isolated(name: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "extkernels.benchmark", "--variants", name, "--rows-only", out]
        subprocess.run(cmd, check=True)
        with open(out) as f:
            return json.load(f)


def run_all(
    names: list[str] | None = None,
    *,
    isolate: bool = True,
    fresh: bool = False,
    verbose: bool = True,
) -> pd.DataFrame:
    """Time the named variants (default: all that can run here) and return the table.

    Variants marked ``isolated`` run in a Python process of their own (unless ``isolate`` is
    false); with ``fresh``, every variant does. The chapters time with ``fresh=True``: a
    notebook's process carries everything that ran before, and host-bound variants (whose
    pace the host's Python sets) would pay for it.

    Returns:
        DataFrame indexed by variant with ``forward_ms``, ``train_ms``, ``forward_speedup``,
        ``train_speedup`` (over the eager brute force of the same workload), ``peak_mb``,
        ``first_call_s`` and the sizes.
    """
    prob = problem()
    chosen = [V.get(n) for n in names] if names else [v for v in V.VARIANTS]
    rows = []
    for v in chosen:
        if not v.available():
            print(f"skip {v.name}: {v.unavailable_reason()}", flush=True)
            continue
        if verbose:
            print(f"run  {v.name}", flush=True)
        own_process = fresh or (v.isolated and isolate)
        rows += _run_isolated(v.name) if own_process else [V.run(v, prob)]
    if not rows:
        raise SystemExit("no chosen variant can run on this machine (see --list)")
    # Speedups within each workload, over its eager brute force.
    workloads = dict.fromkeys(r["workload"] for r in rows)
    df = pd.concat(
        [
            timings_frame([r for r in rows if r["workload"] == w], baseline=f"{w}/torch")
            for w in workloads
        ]
    )
    return df


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m extkernels.benchmark", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--variants", help="comma-separated variant names (default: all)")
    ap.add_argument(
        "--json", default="benchmark.json", help="where to write the table (default: %(default)s)"
    )
    ap.add_argument("--list", action="store_true", help="list the variants and exit")
    ap.add_argument("--rows-only", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.list:
        for v in V.VARIANTS:
            print(
                f"{v.name:28s} chapter {v.chapter:2d}  "
                f"{'runs here' if v.available() else 'not here'}"
            )
        return 0
    names = args.variants.split(",") if args.variants else None
    if args.rows_only:  # child process of an isolated variant
        prob = problem()
        with open(args.rows_only, "w") as f:
            json.dump([V.run(V.get(n), prob) for n in names], f)
        return 0
    df = run_all(names)
    cols = ["forward_ms", "train_ms", "forward_speedup", "train_speedup", "peak_mb", "first_call_s"]
    with pd.option_context("display.width", 160, "display.float_format", "{:.3f}".format):
        print(df[[c for c in cols if c in df]].to_string())
    prob = problem()
    meta = {
        "hardware": prob.hardware,
        "versions": versions()["version"].to_dict(),
        "sizes": {"n_ref": prob.n_ref, "n_ref_radius": prob.n_ref_radius, "n_query": prob.n_query},
    }
    with open(args.json, "w") as f:
        # NaN (no memory statistics on a CPU) becomes null: strict JSON readers reject NaN.
        rows = json.loads(df.reset_index().to_json(orient="records"))
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
