"""Starting ranks and joining them into a process group (chapter 13).

:func:`spawn` starts ``world`` fresh processes with ``torch.multiprocessing`` and
returns what rank 0's function returned; under ``torchrun`` (which sets ``RANK`` and
``WORLD_SIZE``) the process is already one rank and :func:`run_here` runs the function
in place. Either way :func:`init` picks NCCL and one GPU per rank where there are
enough GPUs, gloo on the CPU otherwise.

Ranks on GPUs start as fresh interpreters (``spawn``). Ranks on the CPU fork from a
server process that imported the package once (``forkserver``): each launch still gets
new processes that share nothing with the caller or with earlier launches, without
importing PyTorch and the package again per rank, which is most of a small CPU check's
time.

Every rank turns NVLink SHARP (multicast) off in NCCL, in PyTorch's symmetric memory
and in NVSHMEM before any of them starts: the book's collectives move a few megabytes
and gain nothing from it, and some shared machines do not allow it.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "NO_MULTICAST",
    "init",
    "spawn",
    "run_here",
    "under_torchrun",
    "rank",
    "hardware",
    "max_over_ranks",
]

#: Environment every rank runs with.
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(
    rank: int, world: int, *, device: str | None = None, timeout_s: float = 300
) -> torch.device:
    """Join the process group as ``rank`` of ``world`` and return this rank's device.

    ``device="cpu"`` forces gloo on the CPU (also ``EXTKERNELS_DEVICE=cpu``); by
    default a machine with at least ``world`` GPUs gives every rank its own, over NCCL.
    """
    os.environ.update(NO_MULTICAST)
    device = _requested(device)
    if device == "cuda" and (gpus := torch.cuda.device_count()) < world:
        raise RuntimeError(f"world: expected at most {gpus} ranks (GPUs), got {world}")
    if not _on_cpu(world, device):
        local = int(os.environ.get("LOCAL_RANK", rank))
        here = torch.device("cuda", local)
        torch.cuda.set_device(here)
        backend = "nccl"
    else:
        here = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        backend = "gloo"
    kwargs = {"device_id": here} if backend == "nccl" else {}
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    return here


def _requested(device: str | None) -> str | None:
    """The device asked for: ``device``, else ``EXTKERNELS_DEVICE``, else ``None``."""
    return device or os.environ.get("EXTKERNELS_DEVICE", "").strip().lower() or None


def _on_cpu(world: int, device: str | None) -> bool:
    """Whether :func:`init` puts ``world`` ranks on the CPU (gloo)."""
    device = _requested(device)
    return device == "cpu" or (device != "cuda" and torch.cuda.device_count() < world)


def _start_method(fn: Callable, world: int, device: str | None) -> str:
    """``spawn`` for ranks on GPUs; ``forkserver`` for ranks on the CPU, its server
    preloading the package and ``fn``'s module once per calling process."""
    if not _on_cpu(world, device):
        return "spawn"
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        sorted({"extkernels.distributed.command", fn.__module__})
    )
    return "forkserver"


def _rank_main(rank, world, port, fn, args, device, out, env=None):
    if env is not None:  # the caller's environment now, not the server's at its start
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    here = init(rank, world, device=device)
    try:
        result = fn(here, *args)
        if rank == 0:
            torch.save(result, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world: int, *args, device: str | None = None):
    """Run ``fn(device, *args)`` on ``world`` fresh ranks; return rank 0's result.

    ``fn`` must be importable (a module-level function); its result must be picklable.
    An exception on any rank stops every rank and is raised here.
    """
    if world < 1:
        raise ValueError(f"world: expected at least one rank, got {world}")
    os.environ.update(NO_MULTICAST)  # inherited by the children
    method = _start_method(fn, world, device)
    env = dict(os.environ) if method == "forkserver" else None
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.pt")
        mp.start_processes(
            _rank_main,
            args=(world, _free_port(), fn, args, device, out, env),
            nprocs=world,
            start_method=method,
        )
        return torch.load(out, weights_only=False)


def under_torchrun() -> bool:
    """Whether this process is one rank of a ``torchrun`` launch."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_here(fn: Callable, *args, device: str | None = None):
    """Run ``fn(device, *args)`` as the rank ``torchrun`` made this process; returns
    its result on every rank."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    here = init(rank, world, device=device)
    try:
        result = fn(here, *args)
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def rank() -> int:
    """This process's rank under ``torchrun`` (0 otherwise)."""
    return int(os.environ.get("RANK", 0))


def hardware(world: int, device: str | None = None) -> str:
    """What ``world`` ranks run on here, as the chapter's figures name it: for example
    ``2 x NVIDIA H200`` over NCCL, or ``2 CPU processes`` over gloo."""
    gpus = torch.cuda.device_count() if device != "cpu" else 0
    if gpus >= world:
        return f"{world} x {torch.cuda.get_device_name(0)} (NCCL)"
    return f"{world} CPU processes (gloo)"


def max_over_ranks(values: dict, group=None) -> dict:
    """Each of ``values`` (numbers) at its largest over the ranks of ``group``; call on
    every rank."""
    world = dist.get_world_size(group)
    if world == 1:
        return dict(values)
    every = [None] * world
    dist.all_gather_object(every, values, group=group)
    return {key: max(v[key] for v in every) for key in values}
