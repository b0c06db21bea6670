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
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch

from .. import clouds, reference
from ..ops import fused, knn, radius_aggregate, registry
from ..ops.checks import value_checks
from ..problem import problem
from ..provenance import versions
from ..results import at_size
from ..timing import time_blocks, time_fn

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


def search_methods() -> dict[str, tuple[str, dict]]:
    """The book's search methods, read from the registry (each backend's book record's
    ``methods``), the latest chapter's first: name -> (backend, options of
    :func:`extkernels.knn`). :data:`METHODS` is the same, generated when read."""
    taught = [b for b in registry.registered() if b.book and b.book.methods]
    taught.sort(key=lambda b: -b.book.chapter)
    return {
        name: (b.name, dict(options))
        for b in taught
        for name, options in b.book.methods.items()
    }


def __getattr__(name: str):
    if name == "METHODS":
        return search_methods()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _cuvs(w: clouds.Workload, k: int):
    """cuVS's brute force (squared Euclidean, expanded as |q|^2 + |p|^2 - 2 q.p)."""
    import cupy as cp
    from cuvs.neighbors import brute_force

    def search():
        index = brute_force.build(cp.from_dlpack(w.p_ref), metric="sqeuclidean")
        d2, rows = brute_force.search(index, cp.from_dlpack(w.p_query), k)
        d2 = torch.as_tensor(cp.asarray(d2), device=w.p_ref.device)
        rows = torch.as_tensor(cp.asarray(rows), device=w.p_ref.device)
        return d2.clamp_min(0).sqrt(), rows.long()

    return search


def _cupy_knn(w: clouds.Workload, k: int):
    """cupy-knn's linear BVH (points in Morton order, leaves of 32): built every call;
    its kernels are compiled once, before timing."""
    import cupy as cp
    from cupy_knn import LBVHIndex

    index = LBVHIndex(leaf_size=32)
    index.build(cp.from_dlpack(w.p_ref))
    index.prepare_knn_default(k)

    def search():
        index.build(cp.from_dlpack(w.p_ref))
        rows, d2, _ = index.query_knn(cp.from_dlpack(w.p_query))
        d2 = torch.as_tensor(cp.asarray(d2), device=w.p_ref.device)
        rows = torch.as_tensor(cp.asarray(rows), device=w.p_ref.device)
        return d2.clamp_min(0).sqrt(), rows.long()

    return search


#: Libraries a reader would otherwise pick, called directly: name -> a function of
#: (workload, k) that returns a search (distances, rows).
LIBRARIES = {"cuvs": _cuvs, "cupy-knn": _cupy_knn}


#: The radius aggregation on the same clouds (radius and sigma 0.1, 25 features, as
#: the book's radius projector): name -> backend of :func:`extkernels.radius_aggregate`.
RADIUS = {"fused-radius": "fused", "warp-radius": "warp"}


def searcher(method: str, w: clouds.Workload, k: int):
    """The call that runs ``method`` (a key of :data:`METHODS`, :data:`LIBRARIES` or
    :data:`RADIUS`) once on workload ``w``: a function of no argument, which returns
    the search's ``(distances, rows)`` (a radius method's aggregation)."""
    if method in LIBRARIES:
        return LIBRARIES[method](w, k)
    if method in RADIUS:
        g = torch.Generator().manual_seed(0)
        feats = torch.randn(w.p_ref.shape[0], 25, generator=g).to(w.p_ref.device)
        return lambda: radius_aggregate(
            w.p_query, w.p_ref, feats, 0.1, 0.1, backend=RADIUS[method]
        )
    backend, options = search_methods()[method]
    return lambda: knn(w.p_query, w.p_ref, k, backend=backend, **options)


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
            once = time_fn(fn, 1)  # with every input check, as a first call runs
            n_iters = max(1, min(10, int(budget_ms / max(once, 1e-3))))
            with value_checks(False):  # timed as in every chapter (timing module)
                ms, lo, hi = time_blocks(fn, n_iters, repeats=3)
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
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [
            sys.executable,
            "-m",
            "extkernels.experiments.geometry",
            "run",
            "--methods",
            method,
            "--geometries",
            ",".join(geometries),
            "--sizes",
            ",".join(map(str, sizes)),
            "--side",
            str(side),
            "--out",
            out,
        ]
        child = subprocess.run(cmd, capture_output=True, text=True)
        if child.returncode != 0:  # a library that does not load here: said, skipped
            print(
                f"skip {method}: {child.stderr.strip().splitlines()[-1:]}", flush=True
            )
            return []
        with open(out) as f:
            return json.load(f)


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
    df = pd.DataFrame(rows)
    g = df.groupby(["geometry", "n", "method"], sort=False)["ms"]
    return pd.DataFrame(
        {"ms": g.median(), "min": g.min(), "max": g.max(), "runs": g.size()}
    )


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
    ap.add_argument("command", choices=["check", "bench", "run"])
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
    if args.command == "run":  # one fresh process of bench
        rows = [
            r
            for m in methods
            for r in time_method(m, geometries, sizes, side=args.side)
        ]
        with open(args.out, "w") as f:
            json.dump(rows, f)
        return 0
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


def merge_into(path: str, parts: dict) -> None:
    """Adds ``parts`` to the JSON at ``path`` (runs, checks and traits are appended; a
    method timed or checked again replaces its earlier rows; the meta's date lists
    every call's; ``skipped`` lists the methods that did not load, until one is timed),
    so that several calls build one file."""
    data = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
    parts = dict(parts)
    timed = {r["method"] for r in parts.get("runs", [])}
    skipped = [*data.pop("skipped", []), *parts.pop("skipped", [])]
    if skipped := [m for m in dict.fromkeys(skipped) if m not in timed]:
        data["skipped"] = skipped
    if "meta" in parts and "meta" in data:  # the date of every call, in order
        dates = [*data["meta"]["date"].split(", "), parts["meta"]["date"]]
        meta = {**parts["meta"], "date": ", ".join(dict.fromkeys(dates))}
        parts = {**parts, "meta": meta}
    for key in ("runs", "checks", "traits"):
        if key in parts and key in data:
            again = {r["method"] for r in parts[key]}
            kept = [r for r in data[key] if r["method"] not in again]
            parts = {**parts, key: kept + parts[key]}
    data.update(parts)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
