"""Where a measurement ran: the software and hardware that every chapter prints in its
first cell (chapter 1 onward) and that the benchmark, geometry and distributed
commands record beside their timings."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import re
import subprocess
from pathlib import Path

import pandas as pd
import torch

__all__ = [
    "BOOK_HARDWARE",
    "data_file",
    "gpu_uuid",
    "hardware_slug",
    "joined_meta",
    "short_uuid",
    "versions",
]

#: The GPU behind the book's stored data files (the ``hardware`` of their run cards).
BOOK_HARDWARE = "NVIDIA H200"


def hardware_slug(hardware: str) -> str:
    """The part of a data file's name that says where it ran: a run card's ``hardware``
    (``torch.cuda.get_device_name()``, or the CPU's name) in lower case, the vendor's
    name dropped, every run of other characters a hyphen: ``"NVIDIA H200"`` gives
    ``"h200"``, ``"NVIDIA H100 80GB HBM3"`` gives ``"h100-80gb-hbm3"``."""
    name = re.sub(r"^(nvidia|amd|intel)\b", "", hardware.strip().lower())
    slug = re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    if not slug:
        raise ValueError(f"hardware: expected a device's name, got {hardware!r}")
    return slug


def data_file(kind: str, hardware: str = BOOK_HARDWARE) -> str:
    """The name of a command's data file of ``kind`` (``"benchmark"``,
    ``"benchmark-clouds"``, ``"geometry"``, ...) measured on ``hardware``: what the
    commands write on a machine and the pages read (``benchmark-h200.json``)."""
    return f"{kind}-{hardware_slug(hardware)}.json"


# (label, distribution names to try): the CUDA 12 and CUDA 13 builds have different
# names.
_PACKAGES = [
    ("torch", ("torch",)),
    ("triton", ("triton", "pytorch-triton")),
    ("warp", ("warp-lang",)),
    ("cuml", ("cuml-cu12", "cuml-cu13", "cuml")),
    ("rmm", ("rmm-cu12", "rmm-cu13", "rmm")),
    ("cupy", ("cupy-cuda12x", "cupy-cuda13x", "cupy")),
    ("pyptx", ("pyptx",)),
]


def _version(names: tuple[str, ...]) -> str:
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return "not installed"


def _per_gpu(field: str) -> list[str]:
    """``field`` of every GPU of the host, from ``nvidia-smi`` (which
    ``CUDA_VISIBLE_DEVICES`` does not narrow); empty where it cannot run."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def short_uuid(uuid: str) -> str:
    """A GPU's UUID (``nvidia-smi``'s ``GPU-…`` or torch's) as its first eight hex
    digits: how run cards, campaign jobs and tables name one GPU."""
    return uuid.removeprefix("GPU-")[:8]


def gpu_uuid(index: str) -> str | None:
    """The :func:`short_uuid` of the host's GPU ``index`` (as ``nvidia-smi`` and
    ``CUDA_VISIBLE_DEVICES`` number them); ``None`` where there is no such GPU."""
    uuids = _per_gpu("uuid")
    if not index.isdigit() or int(index) >= len(uuids):
        return None
    return short_uuid(uuids[int(index)])


def _driver() -> str:
    return next(iter(_per_gpu("driver_version")), "n/a")


def _gpus_on_host() -> str:
    """How many GPUs the host holds: a run on one GPU of a four-GPU host shares the
    host's CPU with three neighbours, a run on a one-GPU host does not."""
    names = _per_gpu("name")
    return f"{len(names)} × {names[0]}" if names else "n/a"


def _host_cpu() -> str:
    """The host's processor model and core count: host-bound timings (a launch, a
    Python backward) depend on it as much as on the GPU."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            line.split(":", 1)[1].strip()
            for line in cpuinfo.read_text().splitlines()
            if line.startswith("model name")
        ]
        model = names[0] if names else model
    return f"{model} ({os.cpu_count()} cores)"


def versions() -> pd.DataFrame:
    """The software and hardware this process runs on, one row each."""
    rows = [("python", platform.python_version())]
    # torch's own version string names its build (+cu130, +cpu); the package metadata
    # may not.
    rows += [
        (label, torch.__version__ if label == "torch" else _version(names))
        for label, names in _PACKAGES
    ]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        rows += [
            (
                "device",
                f"{props.name} ({props.total_memory / 2**30:.0f} GiB, "
                f"sm_{props.major}{props.minor})",
            ),
            ("CUDA (torch)", torch.version.cuda or "n/a"),
            ("driver", _driver()),
            ("GPUs on the host", _gpus_on_host()),
            # which GPU of its kind: runs of several sessions may come from several
            ("GPU UUID", str(getattr(props, "uuid", "n/a"))),
        ]
    else:
        rows += [("device", "CPU only (the host CPU below)")]
    rows.append(("host CPU", _host_cpu()))
    return pd.DataFrame(rows, columns=["component", "version"]).set_index("component")


def joined_meta(metas: list[dict], argument: str = "metas") -> dict:
    """One run card for the runs of several files of a command (a campaign's jobs):
    the first file's card with every file's date (once each, earliest first) and, for
    a component whose value differs between the files (another host CPU, another
    GPU), every value once in order, ``not recorded`` standing for the files without
    it (a file merged before gives each of its values). A merged file never claims one
    value for runs that had another. Raises ``ValueError``, naming ``argument`` (the
    caller's), for files from two kinds of GPU (their ``hardware``)."""
    if not metas:
        raise ValueError(f"{argument}: expected the run card of at least one file")
    hardware = {m["hardware"] for m in metas}
    if len(hardware) != 1:
        raise ValueError(
            f"{argument}: expected files from one kind of GPU, got {sorted(hardware)}"
        )
    dates = [d for m in metas for d in m["date"].split(", ")]
    cards = [m.get("versions", {}) for m in metas]
    keys = dict.fromkeys(k for card in cards for k in card)
    values = {
        k: [v for c in cards for v in str(c.get(k, "not recorded")).split("; ")]
        for k in keys
    }
    versions = {k: "; ".join(dict.fromkeys(v)) for k, v in values.items()}
    return {**metas[0], "date": ", ".join(sorted(set(dates))), "versions": versions}
