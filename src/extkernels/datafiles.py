"""The book's data files (``book/data``): which file holds a benchmark variant's runs
(the file of its chapter: chapter 14's clouds and chapter 15's shipping have their own),
and writing the files from a campaign's parts, each named by the GPU its runs came from
(:func:`~extkernels.provenance.data_file`)."""

from __future__ import annotations

import json
from pathlib import Path

from . import benchmark
from . import variants as V
from .distributed import command
from .experiments import batched
from .provenance import BOOK_HARDWARE, data_file
from .searches import merge_into

__all__ = [
    "BESIDE",
    "bench_part",
    "hardware_of",
    "kind_of",
    "machine_part",
    "part_slug",
    "write_files",
]

# Variants that a file of another chapter shows beside its own (their runs are copied).
BESIDE = {
    "benchmark-clouds": ["knn/fused+graphs", "radius/fused+graphs"],
    "benchmark-shipping": ["knn/fused+graphs", "knn/cpp+compile"],
}


def part_slug(name: str) -> str:
    """A job's or variant's name as part of a file's name."""
    return name.replace("/", "__")


def bench_part(name: str) -> str:
    """Where a variant's benchmark job writes, relative to ``--out``."""
    return f"parts/bench/{part_slug(name)}.json"


def machine_part(machine: str) -> str:
    """Where the campaign's run of its machine variant on GPU ``machine`` (a UUID's
    first digits) writes, relative to ``--out``."""
    return f"parts/machines/{machine}.json"


def kind_of(variant) -> str:
    """The kind of data file that holds a benchmark variant's runs: the file of its
    chapter, named by :func:`~extkernels.provenance.data_file` for the hardware."""
    return {14: "benchmark-clouds", 15: "benchmark-shipping"}.get(
        variant.chapter, "benchmark"
    )


def hardware_of(pieces: list[Path]) -> str:
    """The one GPU (a run card's ``hardware``) that the campaign's ``pieces`` ran on.

    Raises:
        ValueError: pieces from more than one GPU (a data file holds one host's runs),
            or none that names its hardware.
    """
    found = set()
    for piece in pieces:
        meta = json.loads(piece.read_text()).get("meta", {})
        if "hardware" in meta:
            found.add(meta["hardware"])
    if len(found) != 1:
        raise ValueError(
            f"pieces: expected runs from one GPU, found {sorted(found) or 'none'}"
        )
    return found.pop()


def write_files(out: Path, data: Path) -> list[str]:
    """The book's data files (in ``data``) from the campaign's parts: the benchmark's
    three files (each variant's runs in the file of its chapter, and copied where
    :data:`BESIDE` shows it), the geometry file, chapter 16's batched file, the
    distributed file and the machines file (one variant timed on each GPU the campaign
    ran on: :func:`~extkernels.benchmark.merge_machines`), each named by the GPU the
    parts ran on (:func:`hardware_of`: one GPU, or an error). A file is written only
    from parts that exist. Returns the variants whose part is missing."""
    parts = out / "parts"
    found = {
        v.name: out / bench_part(v.name)
        for v in V.VARIANTS
        if (out / bench_part(v.name)).exists()
    }
    missing = [v.name for v in V.VARIANTS if v.available() and v.name not in found]
    files: dict[str, list[Path]] = {}
    geometry_pieces = sorted((parts / "geometry").glob("*.json"))
    batched_pieces = sorted((parts / "batched").glob("*.json"))
    machine_pieces = sorted((parts / "machines").glob("*.json"))
    measured = [*found.values(), *geometry_pieces, *batched_pieces, *machine_pieces]
    hardware = hardware_of(measured) if measured else BOOK_HARDWARE
    for v in V.VARIANTS:
        if v.name in found:
            files.setdefault(kind_of(v), []).append(found[v.name])
    for kind, extra in BESIDE.items():
        if kind in files:
            files[kind] += [found[n] for n in extra if n in found]
    for kind, paths in files.items():
        meta, df = benchmark.merge([str(p) for p in paths])
        benchmark.write(str(data / data_file(kind, hardware)), df, meta)
    pieces = geometry_pieces
    if pieces:
        target = data / data_file("geometry", hardware)
        target.unlink(missing_ok=True)
        for piece in pieces:
            merge_into(str(target), json.loads(piece.read_text()))
    if machine_pieces:
        meta, df = benchmark.merge_machines([str(p) for p in machine_pieces])
        benchmark.write(str(data / data_file("machines", hardware)), df, meta)
    if batched_pieces:
        merged = batched.merge([json.loads(p.read_text()) for p in batched_pieces])
        (data / data_file("batched", hardware)).write_text(json.dumps(merged, indent=1))
    pieces = sorted((parts / "distributed").glob("*.json"))
    if pieces:
        merged = command.merge([str(p) for p in pieces])
        (data / data_file("distributed", hardware)).write_text(
            json.dumps(merged, indent=1)
        )
    return missing
