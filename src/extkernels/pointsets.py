"""Batches of labelled point clouds for a model of one's own (chapter 16): each cloud
sampled, by area, on one of several CAD meshes of the ``rtb-data`` wheel (the class is
the mesh), turned by a random rotation, with a random number of points.

A batch is packed as the batched operators take it (:mod:`~extkernels.ops.batches`):
the clouds' points concatenated into ``points`` ``(N, 3)`` float32, cloud ``b`` at rows
``offsets[b]:offsets[b + 1]``, and ``labels`` ``(B,)`` int64. Every batch is made from
the set's seed and its index alone, so batch ``i`` is the same in every process; within
a batch each class has ``B // C`` clouds (the rest go to the first classes), in a
shuffled order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .clouds import stl_triangles

__all__ = ["CLASSES", "Batch", "PointSets", "random_rotations"]

#: The classes: name -> binary STL file inside the ``rtb-data`` wheel.
CLASSES = {
    "panda base": "meshes/FRANKA-EMIKA/Panda/link0_original.stl",
    "panda hand": "meshes/FRANKA-EMIKA/Panda/hand.stl",
    "gimbal ring": "data/gimbal-ring1.stl",
    "spitfire": "data/spitfire_assy-gear_up.stl",
}


@dataclass(frozen=True)
class Batch:
    """Clouds packed along the point axis.

    Attributes:
        points: ``(N, 3)`` float32, every cloud's points in turn.
        offsets: ``(B + 1,)`` int64, cloud ``b`` at rows ``offsets[b]:offsets[b + 1]``.
        labels: ``(B,)`` int64 class of each cloud (an index into :data:`CLASSES`).
    """

    points: torch.Tensor
    offsets: torch.Tensor
    labels: torch.Tensor

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(t.to(device) for t in (self.points, self.offsets, self.labels)))

    def __iter__(self):
        return iter((self.points, self.offsets, self.labels))


def random_rotations(n: int, generator: torch.Generator) -> torch.Tensor:
    """``(n, 3, 3)`` float64 rotation matrices drawn uniformly (the Q of a Gaussian
    matrix's QR decomposition, its signs fixed so that the draw is uniform and the
    determinant +1)."""
    q, r = torch.linalg.qr(
        torch.randn(n, 3, 3, dtype=torch.float64, generator=generator)
    )
    q = q * torch.sign(torch.diagonal(r, dim1=1, dim2=2))[:, None, :]
    flip = torch.linalg.det(q) < 0
    q[flip, :, 0] = -q[flip, :, 0]
    return q


class _Mesh:
    """A mesh's triangles and their areas, kept for repeated sampling."""

    def __init__(self, path: str):
        tri = torch.from_numpy(stl_triangles(path))
        cross = torch.linalg.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0])
        self.triangles, self.area = tri, cross.norm(dim=1)

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``(n, 3)`` float64 points uniform on the surface."""
        pick = torch.multinomial(self.area, n, replacement=True, generator=generator)
        u, v = torch.rand(2, n, 1, dtype=torch.float64, generator=generator)
        flip = (u + v) > 1  # folded back into the triangle
        u, v = torch.where(flip, 1 - u, u), torch.where(flip, 1 - v, v)
        a, b, c = self.triangles[pick].unbind(1)
        return a + u * (b - a) + v * (c - a)


class PointSets:
    """Batches of ``n_clouds`` clouds of ``min_points`` to ``max_points`` points.

    Args:
        n_clouds: clouds per batch.
        min_points, max_points: the range (inclusive) of points per cloud.
        seed: the set's seed; batch ``i`` depends on it and ``i`` only.
        device: where the batches' tensors are put (they are made on the CPU).
        classes: names of :data:`CLASSES` to draw from (default: all).
    """

    def __init__(
        self,
        n_clouds: int,
        min_points: int,
        max_points: int,
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
        classes: tuple[str, ...] | None = None,
    ):
        if not 1 <= min_points <= max_points:
            raise ValueError(
                f"min_points, max_points: expected 1 <= min_points <= max_points, got "
                f"{min_points} and {max_points}"
            )
        if n_clouds < 1:
            raise ValueError(f"n_clouds: expected at least 1, got {n_clouds}")
        self.classes = tuple(CLASSES) if classes is None else tuple(classes)
        unknown = sorted(set(self.classes) - set(CLASSES))
        if unknown:
            raise ValueError(f"classes: expected names of CLASSES, got {unknown}")
        self.n_clouds = n_clouds
        self.min_points, self.max_points = min_points, max_points
        self.seed, self.device = seed, torch.device(device)
        self._meshes = [_Mesh(CLASSES[c]) for c in self.classes]

    def generator(self, index: int) -> torch.Generator:
        """The generator of batch ``index``: seeded by the set's seed and ``index``."""
        if index < 0:
            raise ValueError(f"index: expected a batch index >= 0, got {index}")
        # The CPU generator keeps 32 bits of a seed: the pair is hashed into them.
        key = hashlib.blake2b(f"{self.seed}:{index}".encode(), digest_size=4)
        return torch.Generator().manual_seed(int.from_bytes(key.digest(), "little"))

    def batch(self, index: int) -> Batch:
        """Batch ``index``: balanced classes in a shuffled order, each cloud rotated
        at random and of a random size."""
        g = self.generator(index)
        n_classes = len(self.classes)
        labels = (torch.arange(self.n_clouds) % n_classes)[
            torch.randperm(self.n_clouds, generator=g)
        ]
        sizes = torch.randint(
            self.min_points, self.max_points + 1, (self.n_clouds,), generator=g
        )
        turns = random_rotations(self.n_clouds, g)
        clouds = [
            self._meshes[c].sample(n, g) @ turn.T
            for c, n, turn in zip(labels.tolist(), sizes.tolist(), turns, strict=True)
        ]
        offsets = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
        points = torch.cat(clouds).float()
        return Batch(points, offsets, labels).to(self.device)

    def __getitem__(self, index: int) -> Batch:
        return self.batch(index)
