"""Device and problem sizes, chosen once for the whole book (chapter 1 onward: every
chapter's first cells).

On a CUDA machine the sizes are the ones the book's figures are measured at: a reference
cloud of 100,000 points for the kNN projector, 25,000 for the radius projector, and a
30^3 query grid. Without a GPU, or with ``EXTKERNELS_SMALL=1`` in the environment, every
size shrinks so that a chapter runs in seconds on two CPU cores (this is what the book's
CI executes under nbval). ``EXTKERNELS_DEVICE=cpu`` forces the CPU even where a GPU is
present.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace

import torch

from .clouds import RADIUS_N

__all__ = ["Problem", "problem"]


@dataclass(frozen=True)
class Problem:
    """Everything a chapter needs to know about where and how big it runs.

    Attributes:
        device: where tensors live (``cuda`` or ``cpu``).
        small: True when the sizes were shrunk for a CPU run.
        n_ref: reference points of the kNN workload.
        n_ref_radius: reference points of the radius workload (its brute force needs N x
            M memory).
        grid_side: queries per axis; the query grid holds ``grid_side ** 3`` points.
        k: neighbours per query of the kNN aggregation.
        sigma: length scale of the aggregation weights.
        radius: neighbourhood radius of the radius aggregation.
        hidden: hidden width of both MLPs.
        n_warmup: untimed forward-plus-training iterations before timing.
        n_iters: timed iterations of the forward pass and, separately, of the training
            step.
        repeats: runs of every variant a chapter times, each in a fresh process (median
            and spread): five on a GPU, as the benchmark command makes by default, so
            that a verdict in prose ("faster than") rests on five runs whose ranges do
            not overlap.
        seed: seed of the reference cloud and the targets.
    """

    device: torch.device
    small: bool
    n_ref: int
    n_ref_radius: int
    grid_side: int
    k: int = 7
    sigma: float = 0.1
    radius: float = 0.1
    hidden: int = 25
    n_warmup: int = 5
    n_iters: int = 15
    repeats: int = 5
    seed: int = 0

    @property
    def n_query(self) -> int:
        """Number of query points, ``grid_side ** 3``."""
        return self.grid_side**3

    @property
    def hardware(self) -> str:
        """Name of the device the chapter runs on, as printed under every figure."""
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return "CPU"

    def cloud_size(self, workload: str) -> int:
        """Reference points of ``workload`` (``"knn"`` or ``"radius"``)."""
        return self.n_ref if workload == "knn" else self.n_ref_radius

    def with_sizes(self, **sizes) -> Problem:
        """A copy with some sizes changed (used by the scaling sweeps)."""
        return replace(self, **sizes)


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def problem() -> Problem:
    """Pick the device and the problem sizes for this machine.

    Returns:
        The full sizes of the book on a CUDA device; small sizes (4,000 reference
        points, 12^3 queries) on the CPU or when ``EXTKERNELS_SMALL=1``.
    """
    # The book keeps float32 matrix products in full precision, so that every backend
    # compares with its reference at float32 tolerances; inductor's hint to enable TF32
    # is noise here.
    warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores")
    want_cpu = os.environ.get("EXTKERNELS_DEVICE", "").strip().lower() == "cpu"
    device = torch.device(
        "cuda" if torch.cuda.is_available() and not want_cpu else "cpu"
    )
    small = device.type == "cpu" or _flag("EXTKERNELS_SMALL")
    if small:
        # 4,000 points keep the radius workload's neighbourhoods about as populated as
        # 25,000 points do at full size once the radius is scaled by (25,000 /
        # 4,000)^(1/3).
        return Problem(
            device=device,
            small=True,
            n_ref=4_000,
            n_ref_radius=4_000,
            grid_side=12,
            radius=0.18,
            n_warmup=1,
            n_iters=3,
            repeats=2,
        )
    return Problem(
        device=device, small=False, n_ref=100_000, n_ref_radius=RADIUS_N, grid_side=30
    )
