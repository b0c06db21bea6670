"""The execution command: run chapters top to bottom and store their outputs in place
(chapter 1 onward: every chapter's stored outputs come from it).

    python -m extkernels.execute book/                 # every chapter, in order
    python -m extkernels.execute book/01_eager_baseline.ipynb --timeout 900

The per-cell timeout defaults to 30 minutes, room for a cell that compiles, builds or
packages projectors in fresh processes (chapters 4 and 15); the chapters read the
benchmark command's timings from its file instead of timing its variants again.

Each notebook runs in a fresh kernel with its own folder as working directory. A cell
that raises stops that notebook, which is then left untouched on disk, and the command
exits non-zero after trying the rest; so does a cell with a figure caption
(``mystnb.figure`` in its metadata) that drew no figure and printed no "skipped"
message, or that displayed more than its figure. The stored outputs of the book are
produced by this command on the GPU machine named in each chapter.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

__all__ = [
    "MissingFigureError",
    "crowded_figures",
    "execute",
    "main",
    "missing_figures",
]


class MissingFigureError(RuntimeError):
    """A cell that should hold one figure (it has a caption) holds none, or more."""


def missing_figures(nb: nbformat.NotebookNode) -> list[int]:
    """Indices of the code cells with a figure caption whose outputs hold no PNG and
    no message that the figure was skipped (a GPU-only figure on a CPU)."""
    missing = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or "figure" not in cell.metadata.get("mystnb", {}):
            continue
        outputs = cell.get("outputs", [])
        drawn = any("image/png" in o.get("data", {}) for o in outputs)
        text = "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")
        if not drawn and not text.lstrip().startswith("skipped"):
            missing.append(i)
    return missing


def crowded_figures(nb: nbformat.NotebookNode) -> list[int]:
    """Indices of the code cells with a figure caption that display more than one
    output. myst-nb wraps every displayed output of a captioned cell in a figure of the
    caption's name, so a table shown beside the plot becomes a second figure under the
    same caption and name (a duplicate target, which fails the strict site build): show
    the table from a cell of its own."""
    return [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        and "figure" in cell.metadata.get("mystnb", {})
        and sum(
            o.get("output_type") in ("display_data", "execute_result")
            for o in cell.get("outputs", [])
        )
        > 1
    ]


def _notebooks(paths: list[str]) -> list[Path]:
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(q for q in p.glob("*.ipynb") if not q.name.startswith("_"))
        elif p.suffix == ".ipynb":
            found.append(p)
        else:
            raise SystemExit(
                f"paths: expected notebooks or folders of notebooks, got {p}"
            )
    return found


def execute(path: Path, *, timeout: int, kernel: str) -> float:
    """Execute one notebook in place; returns seconds taken. Raises on a failing
    cell, or on a captioned cell without its figure (:func:`missing_figures`) or with
    more than its figure (:func:`crowded_figures`); the file is then left as it was."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name=kernel,
        resources={"metadata": {"path": str(path.parent)}},
    )
    # The kernel inherits this process's environment. A matplotlib backend chosen for
    # scripts (MPLBACKEND=Agg) would override the kernel's inline backend and leave
    # every figure out of the stored outputs, so the kernel starts without it.
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    start = time.perf_counter()
    client.execute(env=env)
    seconds = time.perf_counter() - start
    if missing := missing_figures(nb):
        raise MissingFigureError(f"cells {missing} of {path} drew no figure")
    if crowded := crowded_figures(nb):
        raise MissingFigureError(
            f"captioned cells {crowded} of {path} display more than their figure"
        )
    nbformat.write(nb, path)
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m extkernels.execute", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("paths", nargs="+", help="notebooks, or folders holding them")
    ap.add_argument(
        "--timeout",
        type=int,
        default=1800,
        help="seconds per cell (default: %(default)s)",
    )
    ap.add_argument(
        "--kernel", default="python3", help="Jupyter kernel name (default: %(default)s)"
    )
    args = ap.parse_args(argv)
    failed = []
    for path in _notebooks(args.paths):
        print(f"executing {path} ...", flush=True)
        try:
            seconds = execute(path, timeout=args.timeout, kernel=args.kernel)
        except (
            CellExecutionError,
            CellTimeoutError,
            DeadKernelError,
            MissingFigureError,
        ) as err:
            print(f"FAILED {path}:\n{err}", file=sys.stderr, flush=True)
            failed.append(path)
            continue
        print(f"ok        {path} in {seconds:.0f} s", flush=True)
    if failed:
        print(
            f"{len(failed)} notebook(s) failed: {', '.join(map(str, failed))}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
