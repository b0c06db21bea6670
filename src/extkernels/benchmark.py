"""The benchmark command: every variant of the running example, timed by the book's
protocol (chapter 1 introduces it; every chapter's timing tables come from it).

    python -m extkernels.benchmark     # every variant that runs here, 5 runs each
    python -m extkernels.benchmark --variants knn/torch,knn/torch+compile --repeats 3

Every variant runs ``--repeats`` times, each in a fresh Python process (a process
carries everything that ran before it, and host-bound variants pay for it). Prints one
table: the median forward and training milliseconds per iteration with their spread
(min-max over the runs), speedups over the eager brute force of the same workload
(ratios of medians), peak memory and the first call's seconds (compile included,
measured cold in the first run). Writes it as JSON with the hardware, versions, sizes,
date and every run's timings.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

import pandas as pd

from . import fresh
from . import variants as V
from .problem import problem
from .provenance import joined_meta, short_uuid, versions
from .timing import timings_frame

__all__ = ["run_all", "merge", "merge_machines", "timed_rows", "write", "main"]


# The compilers' on-disk caches: Inductor's, Triton's and Warp's kernels.
CACHES = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "WARP_CACHE_PATH": "warp",
}


def timed_rows(names: list[str], cold: bool = True) -> list[dict]:
    """The named variants timed in this process (:func:`extkernels.variants.run`), as
    a fresh process of :func:`_run_isolated` sends them back."""
    prob = problem()
    return [V.run(V.get(n), prob, cold=cold) for n in names]


def _run_isolated(
    name: str, *, cold: bool = True, caches: str | None = None
) -> list[dict]:
    """``name`` timed in a fresh Python process. ``cold=False`` lets its first call use
    the compilers' on-disk caches. With ``caches`` (a folder) those caches live there:
    empty for a variant's first run, what that run left for its later ones. The
    child's warnings (graph breaks a variant makes on purpose, one-time messages of
    the libraries) would repeat in every run: shown only on failure, in the
    :class:`~extkernels.fresh.FreshProcessError`."""
    env = {}
    if caches is not None:
        env = {var: os.path.join(caches, sub) for var, sub in CACHES.items()}
    try:
        return fresh.call("extkernels.benchmark", "timed_rows", [name], cold, env=env)
    except fresh.FreshProcessError as e:
        raise fresh.FreshProcessError(
            f"variant {name}", e.returncode, e.stderr
        ) from None


def run_all(
    names: list[str] | None = None,
    *,
    repeats: int = 1,
    isolate: bool = True,
    fresh: bool = False,
    verbose: bool = True,
) -> pd.DataFrame:
    """Time the named variants (default: all that can run here) and return the table.

    With ``repeats > 1`` every variant runs that many times, each in a fresh Python
    process; the first run measures its first call cold (the compilers' caches empty),
    the later ones with the caches it left (``warm_first_call_s``). With one repeat,
    variants marked ``isolated`` still run in a process of their own (unless
    ``isolate`` is false), and with ``fresh`` every variant does. The chapters time
    with ``repeats=problem().repeats``, as the benchmark command does.

    Returns:
        DataFrame indexed by variant (see :func:`~extkernels.timing.timings_frame`):
        median ``forward_ms`` and ``train_ms`` with ``*_min``/``*_max`` and ``repeats``,
        ``forward_speedup`` and ``train_speedup`` over the eager brute force of the same
        workload, ``peak_mb``, ``first_call_s`` and the sizes.
    """
    if repeats < 1:
        raise ValueError(f"repeats: expected at least 1 run per variant, got {repeats}")
    prob = problem()
    chosen = [V.get(n) for n in names] if names else [v for v in V.VARIANTS]
    rows = []
    for v in chosen:
        if not v.available():
            print(f"skip {v.name}: {v.unavailable_reason()}", flush=True)
            continue
        if verbose:
            print(f"run  {v.name}", flush=True)
        if repeats > 1 or fresh or (v.isolated and isolate):
            with tempfile.TemporaryDirectory() as caches:  # a reader's first run, then
                for r in range(repeats):  # the runs after it
                    rows += _run_isolated(v.name, cold=r == 0, caches=caches)
        else:
            rows.append(V.run(v, prob))
    if not rows:
        raise SystemExit("no chosen variant can run on this machine (see --list)")
    return frame(rows)


def frame(rows: list[dict]) -> pd.DataFrame:
    """Runs of several workloads as one table, speedups within each workload over its
    eager brute force; every run's row kept in ``attrs["runs"]`` for the JSON record."""
    workloads = dict.fromkeys(r["workload"] for r in rows)
    df = pd.concat(
        [
            timings_frame(
                [r for r in rows if r["workload"] == w], baseline=f"{w}/torch"
            )
            for w in workloads
        ]
    )
    df.attrs["runs"] = rows
    return df


def write(path: str, df: pd.DataFrame, meta: dict) -> None:
    with open(path, "w") as f:
        # NaN (no memory statistics on a CPU) becomes null: strict JSON readers reject
        # NaN.
        rows = json.loads(df.reset_index().to_json(orient="records"))
        runs = json.loads(pd.DataFrame(df.attrs["runs"]).to_json(orient="records"))
        json.dump({"meta": meta, "rows": rows, "runs": runs}, f, indent=1)
    print(f"wrote {path}")


def merge(paths: list[str]) -> tuple[dict, pd.DataFrame]:
    """Several files of this command, from one machine, as one: the runs of every file,
    the table rebuilt from them (so speedups use the baseline wherever it was timed).
    A variant timed again in a later file keeps only the later file's runs: a
    re-measurement replaces the old one, never mixes with it. One run card for all
    (:func:`~extkernels.provenance.joined_meta`)."""
    metas, runs = [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        metas.append(data["meta"])
        again = {r["variant"] for r in data["runs"]}
        runs = [r for r in runs if r["variant"] not in again] + data["runs"]
    return joined_meta(metas, "paths"), frame(runs)


def merge_machines(paths: list[str]) -> tuple[dict, pd.DataFrame]:
    """Files of this command that time one variant, each on another GPU of one kind (a
    campaign's ``machines:`` jobs), as one table with a row per GPU: its runs' medians
    and spreads, indexed by the first eight digits of the GPU's UUID, with the variant
    and the date it ran. One run card for all
    (:func:`~extkernels.provenance.joined_meta`).

    Raises:
        ValueError: files that time other variants, or two files from one GPU.
    """
    metas, runs, gpus = [], [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        meta = data["meta"]
        gpus.append(short_uuid(meta["versions"]["GPU UUID"]))
        metas.append(meta)
        runs += [
            {**r, "variant": gpus[-1], "timed": r["variant"], "date": meta["date"][:10]}
            for r in data["runs"]
        ]
    timed = {r["timed"] for r in runs}
    if len(timed) != 1:
        raise ValueError(f"paths: expected runs of one variant, got {sorted(timed)}")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"paths: expected one file per GPU, got GPUs {gpus}")
    return joined_meta(metas, "paths"), frame(runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m extkernels.benchmark", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--variants", help="comma-separated variant names (default: all)")
    ap.add_argument(
        "--json",
        default="benchmark.json",
        help="where to write the table (default: %(default)s)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="runs per variant, each in a fresh process",
    )
    ap.add_argument("--list", action="store_true", help="list the variants and exit")
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="FILE",
        help="merge files of this command into --json",
    )
    args = ap.parse_args(argv)
    if args.list:
        for v in V.VARIANTS:
            print(
                f"{v.name:28s} chapter {v.chapter:2d}  "
                f"{'runs here' if v.available() else 'not here'}"
            )
        return 0
    if args.merge:
        meta, df = merge(args.merge)
        write(args.json, df, meta)
        return 0
    names = args.variants.split(",") if args.variants else None
    df = run_all(names, repeats=args.repeats)
    cols = [
        "forward_ms",
        "forward_min",
        "forward_max",
        "train_ms",
        "train_min",
        "train_max",
    ]
    cols += ["forward_speedup", "train_speedup", "peak_mb", "first_call_s"]
    with pd.option_context(
        "display.width", 200, "display.float_format", "{:.3f}".format
    ):
        print(df[[c for c in cols if c in df]].to_string())
    prob = problem()
    meta = {
        "hardware": prob.hardware,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "repeats": args.repeats,
        "versions": versions()["version"].to_dict(),
        "sizes": {
            "n_ref": prob.n_ref,
            "n_ref_radius": prob.n_ref_radius,
            "n_query": prob.n_query,
        },
    }
    write(args.json, df, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
