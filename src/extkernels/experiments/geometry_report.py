"""The numbers chapter 14 quotes from the geometry command's tables
(:mod:`extkernels.experiments.geometry`), the benchmark on other clouds and the traits
of each search (:mod:`extkernels.experiments.traits`): each function returns
``{glue name: value}``, values plain Python (``float``, ``str``), for the chapter's
hidden glue cells.
"""

from __future__ import annotations

import pandas as pd
import torch

from .. import clouds
from ..results import at_size
from ..timing import ranked

__all__ = [
    "cliff_quotes",
    "mesh_quotes",
    "radius_vs_warp_quotes",
    "traits_quotes",
    "tree_quotes",
]


def _names(index) -> str:
    return ", ".join(index) if len(index) else "none"


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


def tree_quotes(times: pd.DataFrame, goals: pd.DataFrame) -> dict[str, float | str]:
    """The tree's numbers in chapter 14 (``goals``:
    :func:`~extkernels.experiments.geometry.targets` of ``times``): its slowest cloud
    and ms at 10^5 and 10^6 points, its range of speedups over cuML, the tree and the
    grid on the book's cloud at 10^5, and the clouds where it misses a goal."""
    small = at_size(times, 100_000, ["fused", "fused-grid"]).loc["normal"]
    missed = goals.index[~goals[["≤ 0.5 ms", "≤ 2 ms", "≥ 10×"]].all(axis=1)]
    return {
        "tree_max_small": float(goals["ms at 10⁵"].max()),
        "tree_max_small_cloud": goals["ms at 10⁵"].idxmax(),
        "tree_max_large": float(goals["ms at 10⁶"].max()),
        "tree_max_large_cloud": goals["ms at 10⁶"].idxmax(),
        "tree_min_x_cuml": float(goals["x cuml at 10⁶"].min()),
        "tree_max_x_cuml": float(goals["x cuml at 10⁶"].max()),
        "normal_tree_ms": float(small["fused"]),
        "normal_grid_ms": float(small["fused-grid"]),
        "tree_missed": _names(missed),
    }


def radius_vs_warp_quotes(
    times: pd.DataFrame, n: int = clouds.RADIUS_N
) -> dict[str, str]:
    """The fused radius walk against Warp's hash grid, search against search, on every
    cloud of the geometry command (``times``:
    :func:`~extkernels.experiments.geometry.table`), for the results page: where its
    slowest run beats Warp's fastest, where the ranges overlap, and where Warp's median
    is the lower, as one phrase (``radius_vs_warp``)."""
    runs = times.xs(n, level="n")
    ours = runs.xs("fused-radius", level="method")
    warp = runs.xs("warp-radius", level="method")
    order = pd.Series(
        {
            g: ranked(
                (ours.at[g, "min"], ours.at[g, "max"]),
                (warp.at[g, "min"], warp.at[g, "max"]),
                same="lower" if ours.at[g, "ms"] < warp.at[g, "ms"] else "higher",
            )
            for g in ours.index
        }
    )
    apart = order.index[order == "faster than"]
    overlap = order.index[order == "lower"]
    behind = order.index[order.isin(["higher", "slower than"])]
    if len(apart) == len(ours):
        return {"radius_vs_warp": "on every cloud, beyond the spread of the runs"}
    parts = [f"on {_names(apart)}, beyond the spread of the runs"] if len(apart) else []
    if len(overlap):
        parts.append(
            f"on {_names(overlap)} its median is the lower but the ranges of the runs "
            "overlap, so the difference there is within the noise"
        )
    if len(behind):
        parts.append(f"on {_names(behind)} Warp's median is the lower")
    return {"radius_vs_warp": "; ".join(parts)}


def mesh_quotes(on_clouds: pd.DataFrame) -> dict[str, float]:
    """The projectors on a CAD mesh in chapter 14 (``on_clouds``:
    :func:`~extkernels.results.clouds_table`): the tree's worst ratio to the book's
    cloud, forward or training step, and the radius projector's ratios on the Panda
    mesh."""
    knn_ratios = on_clouds.xs("knn/fused+graphs")[
        ["forward / normal", "train / normal"]
    ]
    radius_mesh = on_clouds.xs("radius/fused+graphs").loc["panda"]
    return {
        "mesh_worst": float(knn_ratios.max().max()),
        "radius_mesh_fwd": float(radius_mesh["forward / normal"]),
        "radius_mesh_train": float(radius_mesh["train / normal"]),
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


def traits_quotes(props: pd.DataFrame) -> dict[str, str]:
    """The methods whose call makes the host wait and those captured in a CUDA graph
    that replays correctly (chapter 14; ``props``: a row per method with the booleans
    ``waits`` and ``captures``)."""
    return {
        "methods_waiting": _names(props.index[props["waits"]]),
        "methods_capturing": ", ".join(props.index[props["captures"]]),
    }
