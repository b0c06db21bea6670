"""The kNN search on real and awkward geometry (chapter 14): every search method on
every cloud of :mod:`~extkernels.clouds`, checked and timed.

    python -m extkernels.experiments.geometry check --sizes 100000
    python -m extkernels.experiments.geometry bench --sizes 100000,1000000 --repeats 3

``bench`` runs every method ``--repeats`` times, each in a fresh Python process that
times it on every (cloud, size): milliseconds per call of the public entry point
:func:`extkernels.knn` (search only, k = 7, ``side^3`` queries), the median of 3
blocks of calls. As in every chapter's timing (:mod:`extkernels.timing`), the first
call runs every input check and the timed calls skip the checks of tensor values,
which make the host wait for the GPU on each call. The radius methods
(``fused-radius``, ``warp-radius``) time :func:`extkernels.radius_aggregate` the same
way (radius 0.1, 25 features). The table gives, per (cloud, size, method), the median
over the processes and its spread (min-max), and writes every run as JSON.

The methods by name (:func:`searcher`, :data:`METHODS`, :data:`LIBRARIES`,
:data:`RADIUS`) and :func:`merge_into`, which the traits command shares, live in
:mod:`extkernels.searches` and are named here too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import pandas as pd
import torch

from .. import clouds, fresh, reference
from ..ops import fused
from ..problem import problem
from ..provenance import versions
from ..results import at_size
from ..searches import LIBRARIES, RADIUS, merge_into, search_methods, searcher
from ..timing import runs_table, time_within_budget

__all__ = [
    "LIBRARIES",
    "METHODS",  # noqa: F822  (generated when read, see __getattr__)
    "search_methods",
    "RADIUS",
    "at_size",
    "bench",
    "check",
    "load",
    "main",
    "merge_into",
    "searcher",
    "table",
    "time_method",
    "work_table",
]


def __getattr__(name: str):
    if name == "METHODS":
        return search_methods()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check(method: str, geometries, sizes, *, k: int = 7, side: int = 30) -> list[dict]:
    """Each (cloud, size) searched once by ``method`` and compared with SciPy's k-d
    tree in float64 (:func:`~extkernels.reference.validate_knn`): rows of ``exact`` and
    the largest distance error relative to the cloud's extent."""
    rows = []
    device = problem().device
    for name in geometries:
        for n in sizes:
            w = clouds.workload(name, n, side=side, device=device)
            d, i = searcher(method, w, k)()
            ref_d, _ = reference.knn_reference(w.p_query, w.p_ref, k)
            extent = float((w.p_ref.amax(0) - w.p_ref.amin(0)).max())
            err = float(abs(d.double().cpu().numpy() - ref_d).max())
            try:
                exact = reference.validate_knn(
                    w.p_query, w.p_ref, d, i, k, atol=1e-6 * max(extent, 1.0)
                )
            except AssertionError:
                exact = False
            rows.append(
                {
                    "geometry": name,
                    "n": n,
                    "method": method,
                    "exact": exact,
                    "error": err / extent,
                }
            )
    return rows


def time_method(
    method: str,
    geometries,
    sizes,
    *,
    k: int = 7,
    side: int = 30,
    budget_ms: float = 300,
) -> list[dict]:
    """Milliseconds per search of ``method`` on each (cloud, size), in this process:
    the median of 3 blocks of calls, each block about ``budget_ms`` long (at least one
    call, at most 10), after a first call with every input check; the timed calls skip
    the value checks."""
    rows = []
    device = problem().device
    for name in geometries:
        for n in sizes:
            w = clouds.workload(name, n, side=side, device=device)
            fn = searcher(method, w, k)
            ms, lo, hi, n_iters = time_within_budget(fn, budget_ms, 10)
            rows.append(
                {
                    "geometry": name,
                    "n": n,
                    "method": method,
                    "ms": ms,
                    "block_min": lo,
                    "block_max": hi,
                    "iters": n_iters,
                }
            )
            del w, fn
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def _in_process(method: str, geometries, sizes, side: int) -> list[dict]:
    try:
        return fresh.call(
            "extkernels.experiments.geometry",
            "time_method",
            method,
            list(geometries),
            list(sizes),
            side=side,
        )
    except fresh.FreshProcessError as e:  # a library that does not load here: skipped
        print(f"skip {method}: {e.stderr.strip().splitlines()[-1:]}", flush=True)
        return []


def bench(
    methods, geometries, sizes, *, repeats: int = 3, side: int = 30
) -> list[dict]:
    """Every method ``repeats`` times, each in a fresh process; the runs' rows, each
    with its ``run`` number."""
    rows = []
    for r in range(repeats):
        for method in methods:
            print(f"run {r + 1}/{repeats} {method}", flush=True)
            rows += [
                {**row, "run": r}
                for row in _in_process(method, geometries, sizes, side)
            ]
    return rows


def table(rows: list[dict]) -> pd.DataFrame:
    """One row per (geometry, n, method): the median of the runs' times and their
    spread, in ms."""
    return runs_table(rows, ["geometry", "n", "method"])


def load(path) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    """This command's JSON: its meta, the timing table (:func:`table`) and the
    exactness checks."""
    data = json.loads(Path(path).read_text())
    return data["meta"], table(data["runs"]), pd.DataFrame(data.get("checks", []))


def work_table(n: int, side: int, k: int = 7) -> pd.DataFrame:
    """The work of one query's search on each cloud, replayed on the CPU (chapter 9's
    grid walk and the tree's descent): the mean cells or boxes looked into and points
    tested per query."""
    rows = {}
    for name in clouds.GEOMETRIES:
        w = clouds.workload(name, n, side=side)
        grid = fused.knn_work(w.p_query, w.p_ref, k, index="grid").double().mean(0)
        tree = fused.knn_work(w.p_query, w.p_ref, k, index="tree").double().mean(0)
        rows[name] = {
            "grid cells": grid[0].item(),
            "grid points": grid[1].item(),
            "tree boxes": tree[0].item(),
            "tree points": tree[1].item(),
        }
    return pd.DataFrame(rows).T.round(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m extkernels.experiments.geometry",
        description=__doc__.split("\n\n")[0],
    )
    ap.add_argument("command", choices=["check", "bench"])
    ap.add_argument(
        "--methods", default=",".join([*search_methods(), *LIBRARIES, *RADIUS])
    )
    ap.add_argument("--geometries", default=",".join(clouds.GEOMETRIES))
    ap.add_argument("--sizes", default="100000")
    ap.add_argument("--side", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="geometry.json")
    args = ap.parse_args(argv)
    methods, geometries = args.methods.split(","), args.geometries.split(",")
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.command == "check":  # exactness on every cloud
        rows = []
        for m in [m for m in methods if m not in RADIUS]:  # kNN searches only
            try:
                rows += check(m, geometries, sizes, side=args.side)
            except Exception as e:  # noqa: BLE001  (a library that fails here)
                print(f"skip {m}: {type(e).__name__}: {e}", flush=True)
        print(pd.DataFrame(rows).to_string())
        merge_into(args.out, {"checks": rows})
        return 0
    rows = bench(methods, geometries, sizes, repeats=args.repeats, side=args.side)
    if not rows:  # no method loaded here (each run said why): nothing to time
        print(f"nothing timed: {', '.join(methods)} did not load here", flush=True)
        merge_into(args.out, {"skipped": methods})
        return 0
    with pd.option_context(
        "display.width", 200, "display.float_format", "{:.3f}".format
    ):
        print(table(rows).unstack("method")["ms"].to_string())
    meta = {
        "hardware": problem().hardware,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "repeats": args.repeats,
        "k": 7,
        "n_query": args.side**3,
        "versions": versions()["version"].to_dict(),
    }
    merge_into(args.out, {"meta": meta, "runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
