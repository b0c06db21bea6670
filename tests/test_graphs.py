"""Whole steps in one CUDA graph (``extkernels.graphs``) with the Warp operators inside.

The replay tests need a GPU (they run on the book's GPU machine); on the CPU this file
checks the refusals and the one assumption the capture makes about Warp's memory layout.
"""

import pytest
import torch

import extkernels
from extkernels import graphs, variants
from extkernels.models import Projector, RadiusAggregation
from extkernels.ops import warp as wb
from extkernels.ops.warp import grids
from extkernels.training import make_train_step

pytestmark = pytest.mark.skipif(not wb.available(), reason="warp-lang is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


N_REF = 2000
GRID_SIDE = 8
RADIUS = 0.3
SIGMA = 0.1
HIDDEN = 25


def test_descriptor_layout_is_the_one_copied():
    # Raises when Warp's grid descriptor no longer ends with the cell width at the
    # copied size.
    grids.check_descriptor_layout.cache_clear()
    grids.check_descriptor_layout()


def test_rejects_no_warmup():
    with pytest.raises(ValueError, match="warmup: expected at least 1"):
        graphs.CapturedStep(lambda: None, warmup=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_rejects_machine_without_cuda():
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        graphs.CapturedStep(lambda: None)
    v = variants.get("radius/warp+graphs")
    assert not v.available()
    assert "CUDA graphs" in v.unavailable_reason()


def data(seed=0, n_ref=N_REF, shift=0.0):
    p_ref = extkernels.reference_cloud(n_ref, seed=seed).cuda()
    p_query = extkernels.query_grid(GRID_SIDE).cuda() + shift
    target = extkernels.targets(p_query.shape[0], seed=seed).cuda()
    return p_query, p_ref, target


def projector(seed=0):
    torch.manual_seed(seed)
    return Projector(RadiusAggregation(RADIUS, SIGMA, backend="warp"), HIDDEN).cuda()


def eager_forward(model, p_query, p_ref):
    with torch.no_grad():
        return model(p_query, p_ref)


@pytest.mark.gpu
@needs_cuda
def test_replay_recomputes_on_new_points():
    model = projector()
    p_query, p_ref, _ = data()
    forward = graphs.captured_forward(model, p_query, p_ref)
    first = forward().clone()
    torch.testing.assert_close(
        first, eager_forward(model, p_query, p_ref), rtol=1e-5, atol=1e-6
    )
    # New data copied into the captured inputs: the replay searches the new
    # neighbourhoods.
    new_query, new_ref, _ = data(seed=1, shift=0.05)
    p_query.copy_(new_query)
    p_ref.copy_(new_ref)
    second = forward().clone()
    torch.testing.assert_close(
        second, eager_forward(model, new_query, new_ref), rtol=1e-5, atol=1e-6
    )
    assert not torch.allclose(first, second)


@pytest.mark.gpu
@needs_cuda
def test_replay_survives_other_grids():
    # Warp copies a grid's descriptor from one host variable shared by all grids; a
    # replay after other builds must still query its own grid.
    import warp as wp

    model = projector()
    p_query, p_ref, _ = data()
    expected = eager_forward(model, p_query, p_ref)
    forward = graphs.captured_forward(model, p_query, p_ref)
    other_query, other_ref, _ = data(seed=2, n_ref=N_REF // 2, shift=0.1)
    eager_forward(model, other_query, other_ref)  # the backend builds another grid
    grid = wp.HashGrid(
        16, 16, 16, device="cuda:0"
    )  # and so does anyone using Warp directly
    grid.build(wp.from_torch(other_ref * 3.0, dtype=wp.vec3), 0.5)
    torch.testing.assert_close(forward(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@needs_cuda
def test_captured_grids_belong_to_the_graph(capfd):
    model = projector()
    p_query, p_ref, target = data()
    step = graphs.captured_train_step(model, model.parameters(), p_query, p_ref, target)
    # The capture was registered with Warp: no scratch buffer left behind outside the
    # graph.
    assert "unregistered graph capture" not in capfd.readouterr().err
    kept = [g for g in step.kept if isinstance(g, grids.Grid)]
    assert len(kept) == 1 and kept[0].captured
    with torch.cuda.stream(
        step.stream
    ):  # eager calls on the capture stream take spare grids
        for _ in range(3):
            make_train_step(model, model.parameters(), p_query, p_ref, target)()
    torch.cuda.synchronize()
    assert all(g is not kept[0] for g in grids.POOL.spare_grids())


@pytest.mark.gpu
@needs_cuda
def test_captured_train_step_trains_like_eager():
    p_query, p_ref, target = data()
    eager_model, graph_model = projector(), projector()
    eager = make_train_step(
        eager_model, eager_model.parameters(), p_query, p_ref, target, capturable=True
    )
    eager_losses = [eager().item() for _ in range(6)]
    # The warm-up trains 3 steps eagerly, the capture none; 3 replays make 6.
    step = graphs.captured_train_step(
        graph_model, graph_model.parameters(), p_query, p_ref, target, warmup=3
    )
    graph_losses = [step().item() for _ in range(3)]
    torch.testing.assert_close(graph_losses, eager_losses[3:], rtol=1e-4, atol=1e-6)
    for a, b in zip(eager_model.parameters(), graph_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert eager_losses[-1] < eager_losses[0]  # it did train
