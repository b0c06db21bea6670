"""Chapter 16's timings of batches and neighbour lists, each method of a case in fresh
processes, beside the alternatives a reader has:

- ``batch``: 32 clouds of 2,048 points packed with offsets, self kNN with k = 16, by
  each backend's ``ek.knn`` with offsets (one launch where the backend takes the batch,
  a loop over the clouds where it does not), by a Python loop of single-cloud calls,
  by the fused backend's batched brute force (``fused.knn_batched``, one launch) and
  by PyTorch's brute force on the padded ``(B, P, 3)`` clouds (``cdist`` and
  ``topk``);
- ``single``: one cloud of 4,096 points, self kNN with k = 32: each backend's search
  and the fused backend's batched brute force on that one cloud;
- ``crossover``: batches of 8 clouds of 1,024 to 65,536 points, self kNN with k = 16,
  by the fused backend's batched brute force and by a loop of its tree searches: where
  testing every pair of a cloud stops paying;
- ``radius``: the radius projector's workload (the book's reference cloud and query
  grid, its radius): each backend's ``ek.radius_search`` (CSR, and padded to the 64
  nearest) beside each backend's ``ek.radius_aggregate`` forward pass.

    python -m extkernels.experiments.batched bench --repeats 5 --out batched.json

Each (run, case) is one fresh process that times each of the case's methods in turn
(the median of 5 blocks of calls, value checks off after a first checked call, as in
every chapter); the table gives each method's median over the runs with their spread.
A method that keeps its process past :data:`RUN_TIMEOUT` is recorded as not timed, in
that run and the later ones, and the case's other methods run again in a fresh
process; the command's log keeps where it waited.
On a machine without a GPU the sizes shrink (:func:`sizes`).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch

from .. import fresh
from ..data import features, query_grid, reference_cloud
from ..ops import batches, fused, knn, radius_aggregate, radius_search, registry
from ..problem import problem
from ..provenance import joined_meta, versions
from ..timing import runs_table, time_within_budget

__all__ = [
    "CASES",
    "sizes",
    "methods",
    "time_case",
    "bench",
    "table",
    "load",
    "merge",
    "main",
]

#: The cases, in the order the chapter shows them.
CASES = ("batch", "single", "crossover", "radius")
#: This module as fresh processes import it (``-m`` makes ``__name__`` ``__main__``).
MODULE = "extkernels.experiments.batched"
#: Seconds one fresh process may take to time one case: about 70 at most on one H200.
RUN_TIMEOUT = 180.0


def sizes(small: bool) -> dict:
    """Every case's sizes: the issue's at full size, a few hundred points on the CPU
    (``crossover``: the points per cloud of its batches of 8)."""
    if small:
        return {
            "clouds": 4,
            "points": 256,
            "k": 16,
            "single": 512,
            "k_single": 32,
            "crossover": (64, 256),
        }
    return {
        "clouds": 32,
        "points": 2048,
        "k": 16,
        "single": 4096,
        "k_single": 32,
        "crossover": (1024, 4096, 16384, 65536),
    }


def _cloud(n: int, seed: int, device) -> torch.Tensor:
    return reference_cloud(n, seed=seed, device=device)


def _batch(s: dict, device):
    points = torch.cat([_cloud(s["points"], b, device) for b in range(s["clouds"])])
    lengths = torch.full((s["clouds"],), s["points"], device=device)
    return points, batches.offsets_from_lengths(lengths)


def _padded_brute_force(points, offsets, k):
    """PyTorch's brute force on padded clouds: ``cdist`` and ``topk`` per cloud, in one
    batched call (the clouds here are equal in size, so nothing is masked)."""
    padded, _ = batches.pad_packed(points, offsets)
    d = torch.cdist(padded, padded)
    return d.topk(k, dim=-1, largest=False)


def _loop(points, offsets, k, backend):
    at = offsets.tolist()
    return [
        knn(points[a:b], points[a:b], k, backend=backend)
        for a, b in zip(at[:-1], at[1:], strict=True)
    ]


def methods(case: str, device) -> dict:
    """The case's methods that run on ``device``: name -> a function of no argument
    that builds the inputs (once) and returns the call to time."""
    s = sizes(problem().small)
    here = [b for b in registry.registered() if b.runs_on(device.type)]
    knn_backends = [b.name for b in here if b.implements("knn")]
    out = {}

    def fused_batched(k, single=False):
        def build():
            if single:
                points = _cloud(s["single"], 0, device)
                offsets = points.new_tensor([0, points.shape[0]], dtype=torch.int64)
            else:
                points, offsets = _batch(s, device)
            return lambda: fused.knn_batched(points, points, offsets, offsets, k)

        return build

    if case == "batch":
        k = s["k"]

        def batched(backend):
            def build():
                points, offsets = _batch(s, device)
                return lambda: knn(
                    points,
                    points,
                    k,
                    query_offsets=offsets,
                    ref_offsets=offsets,
                    backend=backend,
                )

            return build

        def looped(backend):
            def build():
                points, offsets = _batch(s, device)
                return lambda: _loop(points, offsets, k, backend)

            return build

        def padded():
            points, offsets = _batch(s, device)
            return lambda: _padded_brute_force(points, offsets, k)

        for b in knn_backends:
            out[f"{b}, offsets"] = batched(b)
        if "fused" in knn_backends:
            out["fused, knn_batched"] = fused_batched(s["k"])
        for b in knn_backends:
            out[f"{b}, loop of clouds"] = looped(b)
        out["torch, cdist + topk on padded clouds"] = padded
    elif case == "single":
        k = s["k_single"]

        def one(backend):
            def build():
                p = _cloud(s["single"], 0, device)
                return lambda: knn(p, p, k, backend=backend)

            return build

        for b in knn_backends:
            out[b] = one(b)
        if "fused" in knn_backends:
            out["fused, knn_batched"] = fused_batched(k, single=True)
    elif case == "radius":
        prob = problem()

        def workload():
            p_ref = _cloud(prob.n_ref_radius, prob.seed, device)
            p_query = query_grid(prob.grid_side, device=device)
            return p_query, p_ref, features(p_ref.shape[0], 1, device=device)

        def search(backend, max_neighbours):
            def build():
                p_query, p_ref, _ = workload()
                return lambda: radius_search(
                    p_query,
                    p_ref,
                    prob.radius,
                    max_neighbours=max_neighbours,
                    backend=backend,
                )

            return build

        def aggregate(backend):
            def build():
                p_query, p_ref, feats = workload()
                return lambda: radius_aggregate(
                    p_query, p_ref, feats, prob.radius, prob.sigma, backend=backend
                )

            return build

        for b in here:
            if b.implements("radius_search"):
                out[f"radius_search {b.name}, CSR"] = search(b.name, None)
                out[f"radius_search {b.name}, 64 nearest"] = search(b.name, 64)
        for b in here:
            if b.implements("radius_aggregate"):
                out[f"radius_aggregate {b.name}, forward"] = aggregate(b.name)
    elif case == "crossover":
        for points in s["crossover"]:
            at = {**s, "clouds": 8, "points": points}

            def build(at=at, backend=None):
                points, offsets = _batch(at, device)
                if backend is None:
                    return lambda: fused.knn_batched(
                        points, points, offsets, offsets, at["k"]
                    )
                return lambda: _loop(points, offsets, at["k"], backend)

            out[f"8 x {points:,}, fused, knn_batched"] = build
            out[f"8 x {points:,}, fused, loop of clouds"] = functools.partial(
                build, backend="fused"
            )
    else:
        raise ValueError(f"case: expected one of {', '.join(CASES)}, got {case!r}")
    return out


def time_case(
    case: str,
    n_blocks: int = 5,
    budget_ms: float = 200,
    skip: Sequence[str] = (),
    started: str | None = None,
) -> list[dict]:
    """Milliseconds per call of each of ``case``'s methods but those in ``skip``, in
    this process: the median of ``n_blocks`` blocks, each about ``budget_ms`` long,
    after a first checked call. A method that raises is recorded with its error, not
    timed. Each method's name goes to standard error, and into the file ``started``
    where given, before it runs: where a run that hangs stopped."""
    device = problem().device
    rows = []
    for name, build in methods(case, device).items():
        if name in skip:
            continue
        print(f"{case}: {name}", file=sys.stderr, flush=True)
        if started:
            Path(started).write_text(name)
        row = {"case": case, "method": name}
        try:
            fn = build()
            with torch.no_grad():
                ms, lo, hi, n_iters = time_within_budget(fn, budget_ms, 200, n_blocks)
        except Exception as e:  # noqa: BLE001  (named in the table, not timed)
            rows.append({**row, "error": f"{type(e).__name__}: {e}"})
            continue
        rows.append(
            {**row, "ms": ms, "block_min": lo, "block_max": hi, "iters": n_iters}
        )
        del fn
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _timed(
    case: str, skipped: dict[str, str], timeout: float, module: str = MODULE
) -> list[dict]:
    """The rows of one fresh process's ``module.time_case(case)``, the methods in
    ``skipped`` left out. A method that keeps the process past ``timeout`` seconds
    joins ``skipped``, with why, and the others run again in another fresh process; a
    process that fails otherwise, or before it names a method, raises
    :class:`~extkernels.fresh.FreshProcessError`."""
    why = f"ran past {timeout:.0f} s in a fresh process"
    with tempfile.TemporaryDirectory(prefix="extkernels-batched-") as tmp:
        started = Path(tmp) / "method"
        while True:  # ends: each pass leaves out one more method, or returns or raises
            started.unlink(missing_ok=True)
            try:
                return fresh.call(
                    module,
                    "time_case",
                    case,
                    skip=sorted(skipped),
                    started=str(started),
                    timeout=timeout,
                )
            except fresh.FreshProcessError as e:
                if e.returncode is not None or not started.exists():
                    raise
                print(e, file=sys.stderr, flush=True)  # where it waited, in the log
                skipped[started.read_text()] = why


def bench(
    cases=CASES,
    *,
    repeats: int = 5,
    timeout: float = RUN_TIMEOUT,
    module: str = MODULE,
) -> list[dict]:
    """Every case ``repeats`` times, each run in a fresh process of at most ``timeout``
    seconds (``module``'s :func:`time_case`); the runs' rows, each with its ``run``
    number. A method that hangs is left out from then on, a row with its error in
    each run; a process that fails before it names a method raises, with where it
    waited."""
    rows = []
    skipped: dict[str, dict[str, str]] = {case: {} for case in cases}
    for r in range(repeats):
        for case in cases:
            print(f"run {r + 1}/{repeats} {case}", flush=True)
            got = _timed(case, skipped[case], timeout, module)
            rows += [{**row, "run": r} for row in got]
            rows += [
                {"case": case, "method": m, "error": why, "run": r}
                for m, why in skipped[case].items()
            ]
    return rows


def table(rows: list[dict]) -> pd.DataFrame:
    """One row per (case, method): the median of the runs' milliseconds, their fastest
    and slowest, and the number of runs; methods that raised are left out."""
    timed = [row for row in rows if "error" not in row]
    return runs_table(timed, ["case", "method"])


def load(path) -> tuple[dict, pd.DataFrame]:
    """This command's JSON: its meta and the timing table (:func:`table`)."""
    data = json.loads(Path(path).read_text())
    return data["meta"], table(data["runs"])


def merge(pieces: list[dict]) -> dict:
    """One file of this command from several (a campaign's job per case): one run
    card for all (:func:`~extkernels.provenance.joined_meta`) and every piece's runs."""
    if not pieces:
        raise ValueError("pieces: expected at least one file of this command")
    runs = [row for piece in pieces for row in piece["runs"]]
    return {
        "meta": joined_meta([piece["meta"] for piece in pieces], "pieces"),
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m extkernels.experiments.batched",
        description=__doc__.split("\n\n")[0],
    )
    ap.add_argument("command", choices=["bench"])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="batched.json")
    args = ap.parse_args(argv)
    for backend in registry.registered():  # built here, not in a timed process
        if backend.runs_here():
            backend.prepare()
    rows = bench(args.cases.split(","), repeats=args.repeats)
    with pd.option_context(
        "display.width", 200, "display.float_format", "{:.3f}".format
    ):
        print(table(rows).to_string())
    for row in {r["method"]: r for r in rows if "error" in r}.values():
        print(f"not timed: {row['method']}: {row['error']}", flush=True)
    prob = problem()
    meta = {
        "hardware": prob.hardware,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "repeats": args.repeats,
        "sizes": sizes(prob.small),
        "versions": versions()["version"].to_dict(),
    }
    Path(args.out).write_text(json.dumps({"meta": meta, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
