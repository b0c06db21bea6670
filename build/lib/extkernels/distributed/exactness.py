"""Does cutting the projector change its numbers? Each rank against one process
(chapter 13).

:func:`compare` runs on every rank of a group: the whole projector in one piece (the
book's :class:`~extkernels.models.Projector` on all queries and points, on the rank's
device) and the rank's share of a layout, from the same initial weights; then one
training step of each. It reports, over all ranks, the largest differences of the
forward outputs, of the gradients after the backward (DDP's averaged ones) and of the
weights after Adam's step, and, for a sharded kNN, whether the merged neighbours are
the single search's.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from .. import data
from ..ops import knn
from ..problem import Problem
from ..profiling import graphs_and_breaks
from .launch import max_over_ranks
from .ops import sharded_knn
from .setups import ddp, make_setup, sharded_projector, single_projector

__all__ = ["compare", "within_float32", "same_neighbours", "compile_report"]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (
        float((a.detach().double() - b.detach().double()).abs().max())
        if a.numel()
        else 0.0
    )


def within_float32(diff: float, scale: float) -> bool:
    """Whether a difference is float32 rounding: ``torch.testing.assert_close``'s
    float32 tolerances (``atol=1e-5``, ``rtol=1.3e-6``) against a value of size
    ``scale``, with the rtol widened 100-fold for sums taken in another order over
    thousands of terms."""
    return diff <= 1e-5 + 1.3e-4 * scale


def same_neighbours(
    want: tuple[torch.Tensor, torch.Tensor],
    have: tuple[torch.Tensor, torch.Tensor],
    p_query: torch.Tensor,
    p_ref: torch.Tensor,
) -> bool:
    """Whether ``have`` (distances, indices) names the k nearest that ``want`` does, up
    to ties: its distances are those of its indices and equal ``want``'s (to float32
    rounding), and a neighbour that ``want`` lacks is tied with the k-th distance.
    (Neighbours at equal distances may come in either order.)"""
    (dw, iw), (dh, ih) = want, have
    true = (p_query.unsqueeze(1) - p_ref[ih]).norm(dim=-1)
    if not (torch.allclose(dh, true, rtol=1e-5) and torch.allclose(dw, dh, rtol=1e-6)):
        return False
    shared = (ih.unsqueeze(2) == iw.unsqueeze(1)).any(dim=2)
    tied = (dh - dw[:, -1:]).abs() <= 1e-6 * dw[:, -1:]
    return bool((shared | tied).all())


def compare(
    device: torch.device,
    workload: str,
    layout: str,
    prob: Problem,
    *,
    n_ref: int | None = None,
    backend: str = "fused",
    compile: bool = False,
) -> dict:
    """One layout against the projector in one piece; call on every rank.

    Returns:
        On every rank, a dict of the largest differences over all ranks
        (``forward``, ``grad``, ``weights``, with the scales ``forward_scale`` and
        ``grad_scale`` they compare with) and ``same_neighbours`` (kNN in the
        ``reference`` layout; ``None`` otherwise).
    """
    n_ref = n_ref or prob.cloud_size(workload)
    torch.manual_seed(prob.seed)
    whole = single_projector(workload, prob, backend)
    state = {k: v.clone() for k, v in whole.state_dict().items()}
    whole.to(device)
    p_query = data.query_grid(prob.grid_side, device=device)
    p_ref = data.reference_cloud(n_ref, seed=prob.seed, device=device)
    target = data.targets(p_query.shape[0], seed=prob.seed, device=device)

    mine = make_setup(
        workload,
        layout,
        prob,
        device=device,
        n_ref=n_ref,
        backend=backend,
        state=state,
        compile=compile,
    )
    rows = mine.rows
    with torch.no_grad():
        expected = rows.of(whole(p_query, p_ref))
    got = mine.forward()

    same = None
    if workload == "knn" and layout == "reference":
        with torch.no_grad():
            want = knn(p_query, p_ref, prob.k, backend=backend)
            have = sharded_knn(
                p_query, mine.p_ref, prob.k, mine.module.rows, backend=backend
            )
        same = same_neighbours(want, have, p_query, p_ref)

    # one training step of each, from the same weights
    F.mse_loss(whole(p_query, p_ref), target).backward()
    want_grads = [p.grad for p in whole.parameters()]
    optimizer = torch.optim.Adam(whole.parameters(), lr=1e-3)
    optimizer.step()
    mine_opt = torch.optim.Adam(mine.module.parameters(), lr=1e-3)
    mine.loss().backward()
    got_grads = [p.grad for p in mine.module.parameters()]
    mine_opt.step()

    local = {
        "forward": _max_diff(got, expected),
        "forward_scale": float(expected.abs().max()) if expected.numel() else 0.0,
        "grad": max(
            _max_diff(g, w) for g, w in zip(got_grads, want_grads, strict=True)
        ),
        "grad_scale": max(float(w.abs().max()) for w in want_grads),
        "weights": max(
            _max_diff(a, b)
            for a, b in zip(mine.module.parameters(), whole.parameters(), strict=True)
        ),
    }
    out = max_over_ranks(local)
    out["same_neighbours"] = same
    out["workload"], out["layout"], out["compiled"] = workload, layout, compile
    out["world"], out["n_ref"], out["n_query"] = mine.world, n_ref, rows.n
    return out


def compile_report(
    device: torch.device,
    workload: str,
    prob: Problem,
    *,
    n_ref: int | None = None,
    backend: str = "fused",
) -> dict:
    """What ``torch.compile`` makes of the sharded projector on this rank; call on every
    rank.

    Returns:
        ``graphs`` and ``breaks`` of the bare :class:`~.ops.ShardedProjector`
        (:func:`~extkernels.profiling.graphs_and_breaks`), the same of it wrapped in
        DDP (``ddp_graphs``, ``ddp_breaks``), and ``ddp_fullgraph``: ``"compiles"``,
        or the explanation (else the first line) of the error that
        ``torch.compile(DDP(...), fullgraph=True)`` raises.
    """
    n_ref = n_ref or prob.cloud_size(workload)
    # Dynamo's note that it ignores DDP's profiler ranges, once per rank and workload
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    module = sharded_projector(workload, n_ref, prob, backend).to(device)
    p_query = data.query_grid(prob.grid_side, device=device)
    p_ref = module.rows.of(data.reference_cloud(n_ref, seed=prob.seed)).to(device)
    bare = graphs_and_breaks(module, p_query, p_ref)
    torch._dynamo.reset()
    wrapped = graphs_and_breaks(ddp(module, device), p_query, p_ref)
    torch._dynamo.reset()
    try:
        torch.compile(ddp(module, device), fullgraph=True)(p_query, p_ref)
        whole = "compiles"
    except Exception as error:  # the error is the finding
        lines = [line.strip() for line in str(error).strip().splitlines()]
        said = [line for line in lines if line.startswith("Explanation:")]
        whole = f"{type(error).__name__}: {(said or lines)[0]}".replace(
            "Explanation: ", ""
        )
    torch._dynamo.reset()
    return {
        "workload": workload,
        "graphs": bare[0],
        "breaks": bare[1],
        "ddp_graphs": wrapped[0],
        "ddp_breaks": wrapped[1],
        "ddp_fullgraph": whole,
    }
