"""Two properties of each search of chapter 14, beside its exactness: does a call make
the host wait for the GPU, and can it be captured in a CUDA graph?

    python -m extkernels.experiments.traits --out book/data/geometry-h200.json

Each method is probed in a fresh process (a failed capture can leave its process's
CUDA state unusable), on the book's cloud at 10^4 points:

- **waits**: the stream first gets a kernel that spins for 50 ms, then the search is
  called; a call that returns to Python before the spin is over did not wait for the
  GPU. One that waits (a copy of a result to the host, a stream synchronisation) would
  stall a training step every iteration and could not be captured either.
- **captures**: the search captured with :class:`torch.cuda.CUDAGraph`, its queries
  then overwritten in place and the graph replayed; it captures when the replay's
  distances equal those of an eager call on the new queries.

The rows are merged into the geometry command's JSON under ``traits``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from .. import clouds, fresh
from ..ops.checks import value_checks
from ..searches import LIBRARIES, merge_into, search_methods, searcher

__all__ = ["captures", "load", "probe", "spin", "waits", "main"]

SPIN_MS = 50.0


def spin(ms: float, side: int = 4096) -> None:
    """Queue at least ``ms`` milliseconds of GPU work on the current stream and return
    at once: float32 matrix products of ``side`` x ``side``, as many as one of them,
    timed first (the only synchronisation), says fill ``ms``."""
    a = torch.rand(side, side, device="cuda")
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    torch.mm(a, a)  # the library's first call, not timed
    start.record()
    torch.mm(a, a)
    end.record()
    end.synchronize()
    for _ in range(math.ceil(ms / start.elapsed_time(end))):
        torch.mm(a, a)


def waits(search) -> bool:
    """True when ``search()`` returns only after the GPU's queued work is done."""
    search()
    torch.cuda.synchronize()
    spin(SPIN_MS)
    t0 = time.perf_counter()
    search()
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return host_ms > SPIN_MS / 2


def captures(search, w: clouds.Workload) -> bool:
    """True when ``search()`` captured in a CUDA graph and replayed on new queries
    (written into the same tensor) gives the distances of an eager call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up away from the default stream
        search()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            d, _ = search()
    except Exception:  # noqa: BLE001  (any library's refusal to be captured)
        return False
    w.p_query.copy_(w.p_query.flip(0) * 0.5)
    graph.replay()
    expected, _ = search()
    return bool(torch.allclose(d, expected, rtol=1e-5, atol=1e-6))


def probe(method: str, n: int = 10_000) -> dict:
    """Both properties of ``method`` (a kNN method of the geometry command), with the
    book's value checks off, as inside a captured training step: with them on, every
    entry point of the book waits once per call, for its check of finite points."""
    w = clouds.workload("normal", n, side=20, device="cuda")
    search = searcher(method, w, 7)
    with value_checks(False):
        return {
            "method": method,
            "waits": waits(search),
            "captures": captures(search, w),
        }


def _in_process(method: str) -> dict | None:
    try:
        return fresh.call("extkernels.experiments.traits", "probe", method)
    except fresh.FreshProcessError as e:
        print(f"skip {method}: {e.stderr.strip().splitlines()[-1:]}")
        return None


def load(path) -> list[dict]:
    """The ``traits`` rows of the geometry command's JSON at ``path``."""
    return json.loads(Path(path).read_text()).get("traits", [])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m extkernels.experiments.traits")
    knn_methods = [*search_methods(), *LIBRARIES]
    ap.add_argument("--methods", default=",".join(knn_methods))
    ap.add_argument("--out", default="geometry.json")
    args = ap.parse_args(argv)
    rows = [r for m in args.methods.split(",") if (r := _in_process(m)) is not None]
    for r in rows:
        print(f"{r['method']:12s} waits {r['waits']!s:6s} captures {r['captures']}")
    merge_into(args.out, {"traits": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
