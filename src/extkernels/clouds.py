"""Real and awkward geometry (chapter 14): the clouds a point-cloud model meets, besides
the book's friendly blob, each with the queries it is asked about.

- ``normal``: the book's cloud (chapter 1), queried on its grid over ``[-1, 1]^3``.
- ``panda``, ``spitfire``: points sampled, by area, on the triangles of two CAD meshes
  that the ``rtb-data`` wheel ships (a Franka Panda robot's base, a Spitfire aircraft
  assembly), scaled into ``[-1, 1]^3`` and queried on a grid filling the volume around
  them, as surface-to-volume models query them.
- ``shell``: the unit sphere's surface, queried on the volume around it.
- ``clusters``: 20 tight clusters, queried on the volume around them.
- ``outlier``: the book's cloud and one point at ``x = 10^4``.
- ``slab``: a 100 x 1 x 0.01 slab, queried at its own points.
- ``shuffled``: the book's cloud queried at its own points, in random order.

Every cloud is seeded and made at any size; the queries are ``side^3`` points (a grid,
or that many of the cloud's own points).
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import data

__all__ = [
    "GEOMETRIES",
    "MESHES",
    "Workload",
    "mesh_triangles",
    "sample_surface",
    "stl_triangles",
    "workload",
]

#: Meshes of the ``rtb-data`` wheel: name -> path inside its package.
MESHES = {
    "panda": "meshes/FRANKA-EMIKA/Panda/link0_original.stl",
    "spitfire": "data/spitfire_assy-gear_up.stl",
}

#: The radius methods' cloud size on every geometry: the reference cloud of the book's
#: radius projector (:func:`extkernels.problem.problem`).
RADIUS_N = 25_000

#: Every geometry, and what it is.
GEOMETRIES = {
    "normal": "standard normal, queries on the grid over [-1, 1]^3 (the book's cloud)",
    "panda": "surface of a CAD part (Franka Panda base), volume queries",
    "spitfire": "surface of a CAD assembly (Spitfire aircraft), volume queries",
    "shell": "surface of the unit sphere, volume queries",
    "clusters": "20 tight clusters (sd 0.01), volume queries",
    "outlier": "standard normal plus one point at x = 10⁴, queries on the grid",
    "slab": "uniform in a 100 x 1 x 0.01 slab, queries at its own points",
    "shuffled": "standard normal, queries at its own points in random order",
}


@dataclass(frozen=True)
class Workload:
    """A cloud and its queries.

    Attributes:
        name: one of :data:`GEOMETRIES`.
        p_ref: ``(N, 3)`` float32 reference points.
        p_query: ``(M, 3)`` float32 query points.
    """

    name: str
    p_ref: torch.Tensor
    p_query: torch.Tensor

    @property
    def description(self) -> str:
        return GEOMETRIES[self.name]


def _rtb_data_root() -> Path:
    spec = importlib.util.find_spec("rtbdata")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "rtbdata: the meshes come from the rtb-data wheel; "
            "install it with `pip install rtb-data==2.0.0`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def mesh_triangles(name: str) -> np.ndarray:
    """The triangles of mesh ``name`` (a key of :data:`MESHES`), centred and scaled so
    that its box's longest side spans ``[-1, 1]``.

    Returns:
        ``(T, 3, 3)`` float64: three corners per triangle.
    """
    if name not in MESHES:
        raise ValueError(f"name: expected one of {sorted(MESHES)}, got {name!r}")
    return stl_triangles(MESHES[name])


@functools.cache
def stl_triangles(path: str) -> np.ndarray:
    """The triangles of the binary STL file at ``path`` inside the ``rtb-data``
    wheel, centred and scaled so that its box's longest side spans ``[-1, 1]``.

    Returns:
        ``(T, 3, 3)`` float64: three corners per triangle.
    """
    raw = (_rtb_data_root() / path).read_bytes()
    count = int(np.frombuffer(raw, "<u4", count=1, offset=80)[0])
    if len(raw) != 84 + 50 * count:
        raise ValueError(f"path: expected a binary STL file, got {path!r}")
    record = np.dtype(
        [("normal", "<f4", 3), ("corners", "<f4", (3, 3)), ("attr", "<u2")]
    )
    tri = np.frombuffer(raw, record, count=count, offset=84)["corners"].astype(
        np.float64
    )
    lo, hi = tri.reshape(-1, 3).min(0), tri.reshape(-1, 3).max(0)
    return (tri - (lo + hi) / 2) / ((hi - lo).max() / 2)


def sample_surface(
    triangles: np.ndarray, n: int, generator: torch.Generator
) -> torch.Tensor:
    """``n`` points uniformly on a triangle mesh: a triangle drawn with probability
    proportional to its area, then a uniform point in it.

    Returns:
        ``(n, 3)`` float32.
    """
    tri = torch.from_numpy(triangles)
    area = torch.linalg.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0]).norm(dim=1)
    pick = torch.multinomial(area, n, replacement=True, generator=generator)
    u, v = torch.rand(2, n, 1, dtype=torch.float64, generator=generator)
    flip = (u + v) > 1  # folded back into the triangle
    u, v = torch.where(flip, 1 - u, u), torch.where(flip, 1 - v, v)
    a, b, c = tri[pick, 0], tri[pick, 1], tri[pick, 2]
    return (a + u * (b - a) + v * (c - a)).float()


def _grid(side: int, half: float) -> torch.Tensor:
    return data.query_grid(side) * half


def _own_points(
    p_ref: torch.Tensor, m: int, generator: torch.Generator
) -> torch.Tensor:
    rows = torch.randperm(p_ref.shape[0], generator=generator)[:m]
    return p_ref[rows].clone()


def workload(
    name: str,
    n: int,
    *,
    side: int = 30,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> Workload:
    """The cloud ``name`` (a key of :data:`GEOMETRIES`) of ``n`` points and its
    ``side^3`` queries (fewer when queries are the cloud's own points and ``n`` is
    smaller), drawn on the CPU from ``seed`` and moved to ``device``."""
    if name not in GEOMETRIES:
        raise ValueError(f"name: expected one of {sorted(GEOMETRIES)}, got {name!r}")
    if n < 1:
        raise ValueError(f"n: expected at least one reference point, got {n}")
    g = torch.Generator().manual_seed(seed)
    m = side**3
    if name in ("normal", "outlier", "shuffled"):
        p_ref = data.reference_cloud(n, seed=seed)
        if name == "outlier":
            p_ref[-1] = torch.tensor([1e4, 0.0, 0.0])
        p_query = _own_points(p_ref, m, g) if name == "shuffled" else _grid(side, 1.0)
    elif name in MESHES:
        p_ref = sample_surface(mesh_triangles(name), n, g)
        p_query = _grid(side, 1.1)
    elif name == "shell":
        p_ref = torch.nn.functional.normalize(torch.randn(n, 3, generator=g), dim=1)
        p_query = _grid(side, 1.2)
    elif name == "clusters":
        centres = torch.rand(20, 3, generator=g) * 2 - 1
        p_ref = centres[torch.randint(20, (n,), generator=g)]
        p_ref = p_ref + 0.01 * torch.randn(n, 3, generator=g)
        p_query = _grid(side, 1.0)
    else:  # slab
        p_ref = torch.rand(n, 3, generator=g) * torch.tensor([100.0, 1.0, 0.01])
        p_query = _own_points(p_ref, m, g)
    return Workload(
        name, p_ref.contiguous().to(device), p_query.contiguous().to(device)
    )
