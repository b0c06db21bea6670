"""The numbers chapter 14 quotes from the geometry command's tables
(:mod:`extkernels.experiments.geometry`) and the benchmark on other clouds, and the
work of the radius aggregation on each cloud:
each function returns ``{glue name: value}``, values plain Python (``float``, ``str``),
for the chapter's hidden glue cells.
"""

from __future__ import annotations

import pandas as pd
import torch

from .. import clouds
from ..results import at_size

__all__ = [
    "cliff_quotes",
    "mesh_quotes",
    "radius_pairs",
    "tree_quotes",
]


def cliff_quotes(times: pd.DataFrame, n: int = 1_000_000) -> dict[str, float | str]:
    """The cliff of chapter 14 at ``n`` points: the fused grid's ms on the book's
    cloud, its slowest cloud and ms there, and its worst ratios to cuML's and to its
    own time on the book's cloud (``times``:
    :func:`~extkernels.experiments.geometry.table`)."""
    cliff = at_size(times, n, ["fused-grid", "cuml"])
    grid, normal = cliff["fused-grid"], float(cliff.loc["normal", "fused-grid"])
    return {
        "grid_normal_ms": normal,
        "grid_worst": grid.idxmax(),
        "grid_worst_ms": float(grid.max()),
        "grid_worst_x_cuml": float((grid / cliff["cuml"]).max()),
        "grid_worst_x_normal": float(grid.max() / normal),
    }


def tree_quotes(times: pd.DataFrame) -> dict[str, float | str]:
    """The tree's numbers in chapter 14 (``times``:
    :func:`~extkernels.experiments.geometry.table`): its slowest cloud and ms at 10^5
    and 10^6 points, its range of speedups over cuML at 10^6 (medians of the same
    runs; the first six rounded to 3 digits), and the tree and the grid on the book's
    cloud at 10^5."""
    small = at_size(times, 100_000, ["fused", "fused-grid"])
    large = at_size(times, 1_000_000, ["fused", "cuml"])
    tree_small, tree_large = small["fused"].round(3), large["fused"].round(3)
    x_cuml = (large["cuml"] / large["fused"]).round(3)
    return {
        "tree_max_small": float(tree_small.max()),
        "tree_max_small_cloud": tree_small.idxmax(),
        "tree_max_large": float(tree_large.max()),
        "tree_max_large_cloud": tree_large.idxmax(),
        "tree_min_x_cuml": float(x_cuml.min()),
        "tree_max_x_cuml": float(x_cuml.max()),
        "normal_tree_ms": float(small.loc["normal", "fused"]),
        "normal_grid_ms": float(small.loc["normal", "fused-grid"]),
    }


def mesh_quotes(on_clouds: pd.DataFrame) -> dict[str, float]:
    """The projectors on a CAD mesh in chapter 14 (``on_clouds``:
    :func:`~extkernels.results.clouds_table`): the tree's worst ratio to the book's
    cloud, forward or training step, and the radius projector's forward ratio on the
    Panda mesh."""
    knn_ratios = on_clouds.xs("knn/fused+graphs")[
        ["forward / normal", "train / normal"]
    ]
    radius_mesh = on_clouds.xs("radius/fused+graphs").loc["panda"]
    return {
        "mesh_worst": float(knn_ratios.max().max()),
        "radius_mesh_fwd": float(radius_mesh["forward / normal"]),
    }


def radius_pairs(
    names, n: int, side: int, radius: float, *, device="cpu", chunk: int = 2048
) -> pd.DataFrame:
    """The work the radius aggregation cannot skip on each cloud (chapter 14): the
    reference points within ``radius`` of a query, counted by brute force over the
    ``side^3`` queries of :func:`~extkernels.clouds.workload`. Per cloud: neighbours per
    query, the share of queries with any, the most one query has, and the neighbours
    per query over the book's cloud's (``pairs / normal``; ``names`` holds
    ``"normal"``)."""
    rows = {}
    for name in names:
        w = clouds.workload(name, n, side=side, device=device)
        counts = torch.cat(
            [(torch.cdist(q, w.p_ref) <= radius).sum(1) for q in w.p_query.split(chunk)]
        ).double()
        rows[name] = {
            "neighbours per query": counts.mean().item(),
            "queries with any (%)": 100 * (counts > 0).double().mean().item(),
            "most in one query": counts.max().item(),
        }
    out = pd.DataFrame(rows).T
    out["pairs / normal"] = (
        out["neighbours per query"] / out.loc["normal", "neighbours per query"]
    )
    return out
