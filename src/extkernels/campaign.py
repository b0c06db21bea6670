"""The campaign command: every data file and chapter of the book from one machine in
one pass, its GPUs used as parallel lanes (the results page's run card names the
machine and the campaign's dates).

    python -m extkernels.campaign plan               # the jobs, phase by phase
    python -m extkernels.campaign run --out campaign # run them; run again to resume
    python -m extkernels.campaign status --out campaign

A job is one command of the book (the benchmark command for one variant, chapter 14's
geometry command for one method, chapter 16's batched command for one case, chapter 13's
distributed command, ``pytest -m gpu``, the execution command for one chapter) and
runs alone on its GPU (``CUDA_VISIBLE_DEVICES``), so that its timings see no
neighbour; a job that needs every GPU (chapter 13) waits until the others are done
and runs alone. Phases are barriers: measurements, then the multi-GPU runs, then the
data files are written into ``book/data`` from what the measurements wrote, then the
chapters execute against them, then nbval checks each page against what it now stores.
Each variant is timed once: a file that shows a variant beside its own (chapter 14's
clouds, chapter 15's shipping) gets the same runs as the main file. A campaign resumed
on another machine of the same kind first times one variant (:data:`MACHINE_VARIANT`)
again, once per GPU (``machines:<UUID>``): what separates the machines' runs.

Every job's output goes to ``--out`` (``logs/``, ``parts/``) and its state to
``status.json``; a job that ended well is not run again, so an interrupted campaign
resumes where it stopped. Jobs that time nothing (nbval of the pages) may share a
GPU: ``--gpus 0,0,0 --only nbval:`` runs three of them at once on GPU 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import clouds
from . import variants as V
from .datafiles import bench_part, machine_part, part_slug, write_files
from .experiments import batched, geometry
from .provenance import gpu_uuid

__all__ = ["Job", "plan", "select", "run_jobs", "write_files", "main"]

# NVLink multicast stays off in every process a campaign starts (shared hosts).
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
GEOMETRY_SIZES = "10000,100000,1000000"
DISTRIBUTED_SIZES = "100000,1000000,2000000,4000000,10000000,20000000,40000000"
MULTI_GPU_CHAPTERS = ("13_distributed",)
# The longest pages to execute start first, so that no lane ends the campaign alone.
LONGEST_PAGES = ("15_shipping",)
#: Timed again on each GPU a campaign runs on: eager, so the host's pace shows too.
MACHINE_VARIANT = "knn/fused"


@dataclass
class Job:
    """One command of the campaign.

    Attributes:
        name: unique, ``kind:detail`` (``bench:knn/torch``, ``chapter:results``).
        argv: the command (run from the repository's root).
        phase: jobs of a phase start only when every job of the earlier phases ended.
        gpus: 1 (one lane) or -1 (every lane, alone).
        produces: the file it writes, relative to ``--out`` (``None``: in place).
    """

    name: str
    argv: list[str]
    phase: int
    gpus: int = 1
    produces: str | None = None


def _py(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


def plan(
    *,
    book: Path = Path("book"),
    repeats: int = 5,
    test_workers: int = 4,
    multi_gpu: bool = True,
    machine: str | None = None,
) -> list[Job]:
    """Every job of a campaign on this machine, in the order they start: the
    :data:`MACHINE_VARIANT` on ``machine`` (its GPU's UUID, when known), the geometry
    command per method, its checks and traits, ``pytest -m gpu`` (``test_workers``
    processes on one lane), the variants that can run here (those that build or
    compile first); then chapter 13's distributed runs and chapter 13
    (``multi_gpu``); then every other chapter and the results page; then nbval of
    every page (``pytest``, which compares the cells tagged ``nbval-check-output``)
    against what it stores."""
    jobs: list[Job] = []
    if machine:
        part = machine_part(machine)
        argv = _py("extkernels.benchmark", "--variants", MACHINE_VARIANT)
        argv += ["--repeats", str(repeats), "--json", part]
        jobs.append(Job(f"machines:{machine}", argv, 0, produces=part))
    chosen = [v for v in V.VARIANTS if v.available()]
    chosen.sort(key=lambda v: -(2 * v.jit + v.package + v.compile + v.graphs))
    for v in chosen:
        part = bench_part(v.name)
        argv = _py("extkernels.benchmark", "--variants", v.name)
        jobs.append(
            Job(
                f"bench:{v.name}",
                [*argv, "--repeats", str(repeats), "--json", part],
                0,
                produces=part,
            )
        )
    g = _py("extkernels.experiments.geometry")
    for m in [*geometry.METHODS, *geometry.LIBRARIES, *geometry.RADIUS]:
        part = f"parts/geometry/{m}.json"
        sizes = str(clouds.RADIUS_N) if m in geometry.RADIUS else GEOMETRY_SIZES
        argv = [*g, "bench", "--methods", m, "--sizes", sizes, "--out", part]
        jobs.append(Job(f"geometry:{m}", argv, 0, produces=part))
    part = "parts/geometry/checks.json"
    jobs.append(Job("geometry:checks", [*g, "check", "--out", part], 0, produces=part))
    part = "parts/geometry/traits.json"
    traits = _py("extkernels.experiments.traits", "--out", part)
    jobs.append(Job("geometry:traits", traits, 0, produces=part))
    b = _py("extkernels.experiments.batched", "bench", "--repeats", str(repeats))
    for case in batched.CASES:
        part = f"parts/batched/{case}.json"
        argv = [*b, "--cases", case, "--out", part]
        jobs.append(Job(f"batched:{case}", argv, 0, produces=part))
    # one job: pytest-xdist hands each worker the next test, so that no worker is
    # left alone with the slow files (as with a fixed share of the files each)
    argv = _py("pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests")
    jobs.append(Job("tests:gpu", [*argv, "-n", str(test_workers), "--dist", "load"], 0))
    if multi_gpu:
        for w in ("knn", "radius"):
            part = f"parts/distributed/{w}.json"
            argv = _py(
                "extkernels.distributed", "bench", "--world", "4", "--worlds", "1,2,4"
            )
            argv += ["--workloads", w, "--sizes", DISTRIBUTED_SIZES, "--out", part]
            jobs.append(Job(f"distributed:{w}", argv, 1, gpus=-1, produces=part))
    pages = sorted(book.glob("[0-9][0-9]_*.ipynb")) + [book / "results.ipynb"]
    pages.sort(key=lambda nb: nb.stem not in LONGEST_PAGES)  # stable: the rest in order
    for nb in pages:
        if nb.stem in MULTI_GPU_CHAPTERS and not multi_gpu:
            continue
        multi = nb.stem in MULTI_GPU_CHAPTERS  # alone, before the others
        argv = _py("extkernels.execute", str(nb))
        jobs.append(
            Job(f"chapter:{nb.stem}", argv, 2 if multi else 3, -1 if multi else 1)
        )
        # then nbval on this machine, against the outputs the page now stores
        argv = _py("pytest", "-q", "-p", "no:cacheprovider", str(nb))
        jobs.append(
            Job(f"nbval:{nb.stem}", argv, 4 if multi else 5, -1 if multi else 1)
        )
    first = ("machines:", "geometry:", "tests:", "bench:", "batched:")
    return sorted(
        jobs,
        key=lambda j: (
            j.phase,
            [j.name.startswith(f) for f in first].index(True) if j.phase == 0 else 0,
        ),
    )


def select(jobs: list[Job], only: str) -> list[Job]:
    """The jobs named by ``only``: comma-separated prefixes (``bench:,chapter:01``),
    or whole names where one ends in ``$`` (``bench:radius/warp$`` is that variant
    alone, not ``radius/warp+compile+1thread``)."""
    names = only.split(",")
    exact = {n[:-1] for n in names if n.endswith("$")}
    prefixes = tuple(n for n in names if n and not n.endswith("$"))
    return [j for j in jobs if j.name in exact or j.name.startswith(prefixes)]


def _load_status(out: Path) -> dict:
    path = out / "status.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _save_status(out: Path, status: dict) -> None:
    tmp = out / "status.json.tmp"
    tmp.write_text(json.dumps(status, indent=1))
    tmp.replace(out / "status.json")


def _cores(lanes: list[str], used: list[int]) -> list[int]:
    """The host cores of the lanes ``used`` (their positions in ``lanes``): an equal
    share of this process's cores per lane, so that neighbours on other GPUs do not
    take a timed job's host threads."""
    mine = sorted(os.sched_getaffinity(0))
    share = max(1, len(mine) // len(lanes))
    picked = [c for i in used for c in mine[i * share : (i + 1) * share]]
    return picked or mine


def run_jobs(
    jobs: list[Job],
    lanes: list[str],
    out: Path,
    *,
    timeout: float = 3600,
    poll: float = 1.0,
    between: Callable[[int], None] | None = None,
    start_within: float | None = None,
) -> dict:
    """Run ``jobs`` on ``lanes`` (``CUDA_VISIBLE_DEVICES`` values; ``[""]`` on a machine
    without a GPU; a GPU named twice is two lanes on it), each lane one job at a time,
    phases as barriers; ``between(phase)`` runs when every job of earlier phases has
    ended and before ``phase`` starts. Jobs already ``ok`` in ``out/status.json`` are
    skipped. No job starts later than ``start_within`` seconds after the call (a
    machine lent for a while: what runs when it goes back is lost); the jobs left
    have no status and run when the campaign resumes. Returns the status of every
    job: ``state`` (``ok``, ``failed``, ``timeout``), ``lanes``, ``seconds``,
    ``rc``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    status = _load_status(out)
    pending = [j for j in jobs if status.get(j.name, {}).get("state") != "ok"]
    running: dict[str, tuple[Job, subprocess.Popen, float, list[int]]] = {}
    started_phases: set[int] = set()
    t_end = None if start_within is None else time.time() + start_within
    while pending or running:
        if t_end is not None and time.time() > t_end and pending:
            print(
                f"not started ({start_within:.0f} s passed): {len(pending)} jobs",
                flush=True,
            )
            pending.clear()
        for name, (_job, proc, t0, used) in list(running.items()):
            rc = proc.poll()
            if rc is None and time.time() - t0 > timeout:
                proc.kill()
                rc = proc.wait()
                state = "timeout"
            elif rc is None:
                continue
            else:
                state = "ok" if rc == 0 else "failed"
            seconds = round(time.time() - t0, 1)
            named = [lanes[i] for i in used]
            status[name] = {
                "state": state,
                "rc": rc,
                "lanes": named,
                "seconds": seconds,
            }
            _save_status(out, status)
            print(f"{state:8s} {name} ({seconds:.0f} s)", flush=True)
            del running[name]
        busy = {i for *_, used in running.values() for i in used}
        lowest = min(
            [j.phase for j in pending] + [j.phase for j, *_ in running.values()],
            default=0,
        )
        for job in list(pending):
            if job.phase > lowest:
                break
            if job.phase not in started_phases:  # every earlier phase has ended
                started_phases.add(job.phase)
                if between is not None:
                    between(job.phase)
            free = [i for i in range(len(lanes)) if i not in busy]
            if job.gpus == -1:
                if busy:
                    break  # waits for every lane, and holds back the jobs after it
                used = list(range(len(lanes)))
            elif free:
                used = [free[0]]
            else:
                break
            gpus = ",".join(dict.fromkeys(lanes[i] for i in used))  # each GPU once
            env = {**os.environ, **SAFE_ENV, "CUDA_VISIBLE_DEVICES": gpus}
            cores = _cores(lanes, used)
            env["OMP_NUM_THREADS"] = str(len(cores))
            if job.produces:
                (out / job.produces).parent.mkdir(parents=True, exist_ok=True)
            log = open(
                out / "logs" / f"{part_slug(job.name).replace(':', '-')}.log", "w"
            )
            argv = [str(out / a) if a == job.produces else a for a in job.argv]
            proc = subprocess.Popen(
                argv,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=lambda cores=cores: os.sched_setaffinity(0, cores),
            )
            log.close()
            running[job.name] = (job, proc, time.time(), used)
            status[job.name] = {"state": "running", "lanes": [lanes[i] for i in used]}
            _save_status(out, status)
            print(f"start    {job.name} on {gpus or 'cpu'}", flush=True)
            busy.update(used)
            pending.remove(job)
        time.sleep(poll)
    return status


def _lanes(gpus: str | None) -> list[str]:
    if gpus is not None:
        return gpus.split(",") if gpus else [""]
    return [str(i) for i in range(torch.cuda.device_count())] or [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m extkernels.campaign", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("command", choices=["plan", "run", "status"])
    ap.add_argument("--out", default="campaign", help="logs, parts and status.json")
    ap.add_argument(
        "--gpus",
        help="lanes, e.g. 0,1,2,3 (default: every visible GPU); a GPU named twice is "
        "two lanes on it, for jobs that time nothing (nbval, tests)",
    )
    ap.add_argument(
        "--repeats", type=int, default=5, help="fresh processes per variant"
    )
    ap.add_argument(
        "--only",
        help="comma-separated prefixes of the jobs to run ('name$': that job alone)",
    )
    ap.add_argument(
        "--test-workers",
        type=int,
        default=4,
        help="pytest-xdist workers for the GPU tests",
    )
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per job")
    ap.add_argument(
        "--start-within",
        type=float,
        help="start no job after this many seconds (a machine lent for a while); "
        "run again to resume",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.command == "status":
        for name, s in _load_status(out).items():
            print(f"{s['state']:8s} {s.get('seconds', ''):>8} {name}")
        return 0
    lanes = _lanes(args.gpus)
    multi = len(set(lanes)) >= 4  # GPUs, not lanes
    jobs = plan(
        repeats=args.repeats,
        test_workers=args.test_workers,
        multi_gpu=multi,
        machine=gpu_uuid(lanes[0]),
    )
    if args.only:
        jobs = select(jobs, args.only)
    if args.command == "plan":
        for job in jobs:
            lanes_needed = "all" if job.gpus == -1 else "1"
            print(f"{job.phase}  {lanes_needed:>3}  {job.name}")
        if not multi:
            print("(fewer than 4 GPUs: no distributed runs and no chapter 13)")
        return 0

    def between(phase: int) -> None:
        if phase in (2, 3) and not (out / "files-written").exists():
            missing = write_files(out, Path("book/data"))
            (out / "files-written").write_text(json.dumps(missing))
            print(f"wrote the data files; missing variants: {missing or 'none'}")

    status = run_jobs(
        jobs,
        lanes,
        out,
        timeout=args.timeout,
        between=between,
        start_within=args.start_within,
    )
    bad = [n for n, s in status.items() if s["state"] != "ok"]
    left = [j.name for j in jobs if j.name not in status]
    print(f"{len(status) - len(bad)} jobs ok, {len(bad)} not: {bad}")
    if left:
        print(f"{len(left)} not started: run again to resume")
    return 1 if bad or left else 0


if __name__ == "__main__":
    sys.exit(main())
