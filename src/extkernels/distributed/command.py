"""The command ``python -m extkernels.distributed``: check the layouts against one
process, or time them (chapter 13). See ``--help``; under ``torchrun`` each process is
one rank."""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import pandas as pd

from ..problem import problem
from ..provenance import joined_meta, versions
from . import launch
from .bench import measure, table
from .exactness import compare, compile_report

__all__ = ["checks", "compiling", "bench", "merge", "main"]


def _sizes(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x]


def _problem(grid_side: int | None):
    prob = problem()
    return prob.with_sizes(grid_side=grid_side) if grid_side else prob


def _checks_on_rank(device, workloads, layouts, grid_side, n_ref, backend, compile):
    prob = _problem(grid_side)
    return [
        compare(
            device,
            w,
            layout,
            prob,
            n_ref=n_ref,
            backend=backend,
            compile=compile,
        )
        for w in workloads
        for layout in layouts
    ]


def _compile_on_rank(device, workloads, grid_side, n_ref, backend):
    prob = _problem(grid_side)
    return [
        compile_report(device, w, prob, n_ref=n_ref, backend=backend) for w in workloads
    ]


def _bench_on_rank(device, workloads, kwargs, grid_side):
    prob = _problem(grid_side)
    return [measure(device, w, prob, **kwargs) for w in workloads]


def _run(fn, world: int, *args, device: str | None = None):
    if launch.under_torchrun():
        return launch.run_here(fn, *args, device=device)
    return launch.spawn(fn, world, *args, device=device)


def checks(
    world: int = 2,
    *,
    workloads=("knn", "radius"),
    layouts=("queries", "reference"),
    grid_side: int | None = None,
    n_ref: int | None = None,
    backend: str = "fused",
    compile: bool = False,
    device: str | None = None,
) -> pd.DataFrame:
    """Every (workload, layout) on ``world`` fresh ranks against one process: a table of
    the largest differences (:func:`~.exactness.compare`)."""
    args = (list(workloads), list(layouts), grid_side, n_ref, backend, compile)
    return pd.DataFrame(_run(_checks_on_rank, world, *args, device=device))


def compiling(
    world: int = 2,
    *,
    workloads=("knn", "radius"),
    grid_side: int | None = None,
    n_ref: int | None = None,
    backend: str = "fused",
    device: str | None = None,
) -> pd.DataFrame:
    """What ``torch.compile`` makes of the sharded projector on ``world`` fresh ranks
    (:func:`~.exactness.compile_report`), a row per workload."""
    args = (list(workloads), grid_side, n_ref, backend)
    return pd.DataFrame(_run(_compile_on_rank, world, *args, device=device))


def bench(
    world: int = 2,
    *,
    workloads=("knn", "radius"),
    layouts=("single", "queries", "reference"),
    sizes: list[int],
    worlds: list[int] | None = None,
    grid_side: int | None = None,
    backend: str = "fused",
    compile: bool = False,
    repeats: int = 3,
    blocks: int = 3,
    profile_steps: int = 0,
    device: str | None = None,
) -> dict:
    """Time the layouts in ``repeats`` launches of ``world`` fresh ranks each.

    Returns:
        ``{"runs": every launch's rows, "profiles": the first launch's profiles}``.
    """
    kwargs = dict(
        sizes=list(sizes),
        worlds=worlds or sorted({1, world}),
        layouts=list(layouts),
        backend=backend,
        compile=compile,
        blocks=blocks,
        profile_steps=profile_steps,
    )
    runs, profiles = [], []
    for repeat in range(repeats):
        results = _run(
            _bench_on_rank, world, list(workloads), kwargs, grid_side, device=device
        )
        for workload, result in zip(workloads, results, strict=True):
            runs += [dict(r, run=repeat) for r in result["rows"]]
            if repeat == 0:
                profiles += [dict(p, workload=workload) for p in result["profiles"]]
        kwargs["profile_steps"] = 0  # one profile is enough
    return {"runs": runs, "profiles": profiles}


def merge(paths: list[str]) -> dict:
    """Files of ``bench --out``, from one machine, as one: every file's runs and
    profiles, one run card for all (:func:`~extkernels.provenance.joined_meta`)."""
    files = []
    for path in paths:
        with open(path) as f:
            files.append(json.load(f))
    meta = joined_meta([f["meta"] for f in files], "paths")
    meta["command"] = " ; ".join(f["meta"]["command"] for f in files)
    return {
        "meta": meta,
        "runs": [r for f in files for r in f["runs"]],
        "profiles": [p for f in files for p in f["profiles"]],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m extkernels.distributed")
    parser.add_argument("command", choices=["check", "bench", "merge"])
    parser.add_argument("files", nargs="*", help="merge: files of bench --out")
    parser.add_argument("--world", type=int, default=2, help="ranks to launch")
    parser.add_argument("--workloads", default="knn,radius")
    parser.add_argument("--layouts", default=None, help="default: every layout")
    parser.add_argument("--backend", default="fused")
    parser.add_argument("--grid-side", type=int, default=None)
    parser.add_argument("--n-ref", type=int, default=None, help="check: cloud size")
    parser.add_argument("--sizes", default="100000", help="bench: cloud sizes")
    parser.add_argument("--worlds", default=None, help="bench: e.g. 1,2,4")
    parser.add_argument("--repeats", type=int, default=3, help="bench: launches")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--out", default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    workloads = args.workloads.split(",")
    if args.command == "merge":
        with open(args.out, "w") as f:
            json.dump(merge(args.files), f, indent=1)
        return
    if args.command == "check":
        layouts = (args.layouts or "queries,reference").split(",")
        df = checks(
            args.world,
            workloads=workloads,
            layouts=layouts,
            grid_side=args.grid_side,
            n_ref=args.n_ref,
            backend=args.backend,
            compile=args.compile,
            device=args.device,
        )
        result = {"checks": df.to_dict("records")}
        shown = df
    else:
        layouts = (args.layouts or "single,queries,reference").split(",")
        result = bench(
            args.world,
            workloads=workloads,
            layouts=layouts,
            sizes=_sizes(args.sizes),
            worlds=_sizes(args.worlds) if args.worlds else None,
            grid_side=args.grid_side,
            backend=args.backend,
            compile=args.compile,
            repeats=args.repeats,
            profile_steps=args.profile_steps,
            device=args.device,
        )
        shown = table(result["runs"])
    if launch.under_torchrun() and launch.rank() != 0:
        return
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(shown.to_string(index=False))
    if args.out:
        meta = {
            "hardware": launch.hardware(args.world, args.device),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"
            ),
            "command": " ".join(["python -m extkernels.distributed"] + sys.argv[1:]),
            "versions": versions()["version"].to_dict(),
        }
        with open(args.out, "w") as f:
            json.dump({"meta": meta, **result}, f, indent=1)
