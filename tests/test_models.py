"""The running example's model and data, and the choice of device and sizes."""

import pytest
import torch
from torch import nn

import extkernels
from extkernels.timing import make_train_step

HIDDEN = 8


def _aggregations():
    return {
        "knn": extkernels.KnnAggregation(k=5, sigma=0.1),
        "radius": extkernels.RadiusAggregation(radius=0.5, sigma=0.1),
    }


@pytest.fixture(params=["knn", "radius"])
def projector(request):
    torch.manual_seed(0)
    return extkernels.Projector(_aggregations()[request.param], hidden=HIDDEN)


# ---------------------------------------------------------------- MLP and Projector


def test_mlp_is_three_linear_layers_with_relu_between():
    mlp = extkernels.MLP(3, 16, 2)
    kinds = [type(layer) for layer in mlp]
    assert kinds == [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]


def test_mlp_layer_widths():
    mlp = extkernels.MLP(3, 16, 2)
    linears = [layer for layer in mlp if isinstance(layer, nn.Linear)]
    assert [(lin.in_features, lin.out_features) for lin in linears] == [
        (3, 16),
        (16, 16),
        (16, 2),
    ]


def test_mlp_maps_in_features_to_out_features():
    out = extkernels.MLP(5, 7, 3)(torch.randn(11, 5))
    assert out.shape == (11, 3)


def test_projector_maps_clouds_to_one_output_per_query(projector, p_query, p_ref):
    out = projector(p_query, p_ref)
    assert out.shape == (p_query.shape[0], 1)
    assert out.dtype == torch.float32
    assert bool(torch.isfinite(out).all())


def test_projector_passes_backend_options_to_the_aggregation(p_query, p_ref):
    model = extkernels.Projector(
        extkernels.KnnAggregation(k=5, sigma=0.1, chunk_size=0), hidden=HIDDEN
    )
    with pytest.raises(ValueError, match="^chunk_size:"):
        model(p_query, p_ref)


def test_chunked_aggregation_gives_the_same_projection(p_query, p_ref):
    torch.manual_seed(0)
    plain = extkernels.Projector(
        extkernels.KnnAggregation(k=5, sigma=0.1), hidden=HIDDEN
    )
    torch.manual_seed(0)
    chunked = extkernels.Projector(
        extkernels.KnnAggregation(k=5, sigma=0.1, chunk_size=7), hidden=HIDDEN
    )
    torch.testing.assert_close(chunked(p_query, p_ref), plain(p_query, p_ref))


def _tiny_data():
    p_ref = extkernels.reference_cloud(200, seed=3)
    p_query = extkernels.query_grid(4)
    target = extkernels.targets(p_query.shape[0], seed=3)
    return p_query, p_ref, target


def test_adam_steps_reduce_the_loss(projector):
    p_query, p_ref, target = _tiny_data()
    step = make_train_step(
        projector, projector.parameters(), p_query, p_ref, target, lr=1e-2
    )
    losses = [step().item() for _ in range(15)]
    assert losses[-1] < losses[0]


def test_train_step_returns_a_detached_scalar_loss(projector):
    p_query, p_ref, target = _tiny_data()
    loss = make_train_step(projector, projector.parameters(), p_query, p_ref, target)()
    assert loss.shape == ()
    assert not loss.requires_grad


def test_train_step_updates_parameters(projector):
    p_query, p_ref, target = _tiny_data()
    before = [p.detach().clone() for p in projector.parameters()]
    make_train_step(projector, projector.parameters(), p_query, p_ref, target)()
    assert all(
        not torch.equal(b, p)
        for b, p in zip(before, projector.parameters(), strict=True)
    )


def test_gradients_reach_both_mlps(projector):
    p_query, p_ref, target = _tiny_data()
    make_train_step(projector, projector.parameters(), p_query, p_ref, target)()
    lift_first = projector.lift[0].weight.grad
    head_last = projector.head[-1].weight.grad
    assert lift_first is not None and bool(lift_first.abs().sum() > 0)
    assert head_last is not None and bool(head_last.abs().sum() > 0)


# ---------------------------------------------------------------- data


def test_reference_cloud_is_deterministic_for_a_seed():
    assert torch.equal(
        extkernels.reference_cloud(50, seed=4), extkernels.reference_cloud(50, seed=4)
    )


def test_reference_cloud_ignores_the_global_seed():
    torch.manual_seed(1)
    a = extkernels.reference_cloud(50, seed=4)
    torch.manual_seed(2)
    assert torch.equal(a, extkernels.reference_cloud(50, seed=4))


def test_reference_cloud_differs_for_another_seed():
    assert not torch.equal(
        extkernels.reference_cloud(50, seed=4), extkernels.reference_cloud(50, seed=5)
    )


def test_reference_cloud_shape_and_dtype():
    cloud = extkernels.reference_cloud(50)
    assert cloud.shape == (50, 3)
    assert cloud.dtype == torch.float32
    assert cloud.is_contiguous()


@pytest.mark.parametrize("side", [2, 5])
def test_query_grid_has_side_cubed_points(side):
    grid = extkernels.query_grid(side)
    assert grid.shape == (side**3, 3)
    assert grid.dtype == torch.float32
    assert grid.is_contiguous()


@pytest.mark.parametrize("side", [2, 5])
def test_query_grid_spans_minus_one_to_one_on_each_axis(side):
    grid = extkernels.query_grid(side)
    assert grid.min(dim=0).values.tolist() == [-1.0, -1.0, -1.0]
    assert grid.max(dim=0).values.tolist() == [1.0, 1.0, 1.0]


def test_query_grid_points_are_distinct_and_regular():
    side = 5
    grid = extkernels.query_grid(side)
    assert torch.unique(grid, dim=0).shape[0] == side**3
    for axis in range(3):
        values = torch.unique(grid[:, axis])
        assert values.numel() == side
        torch.testing.assert_close(
            values.diff(), torch.full((side - 1,), 2.0 / (side - 1))
        )


@pytest.mark.parametrize("n", [0, -3])
def test_reference_cloud_rejects_non_positive_size(n):
    with pytest.raises(ValueError, match="^n:"):
        extkernels.reference_cloud(n)


@pytest.mark.parametrize("side", [0, -1])
def test_query_grid_rejects_non_positive_side(side):
    with pytest.raises(ValueError, match="^side:"):
        extkernels.query_grid(side)


def test_targets_and_features_shapes_and_determinism():
    assert extkernels.targets(9, seed=2).shape == (9, 1)
    assert extkernels.features(9, 4, seed=2).shape == (9, 4)
    assert torch.equal(
        extkernels.features(9, 4, seed=2), extkernels.features(9, 4, seed=2)
    )


# ---------------------------------------------------------------- problem()


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("EXTKERNELS_SMALL", raising=False)
    monkeypatch.delenv("EXTKERNELS_DEVICE", raising=False)
    return monkeypatch


def test_problem_small_flag_gives_small_sizes(clean_env):
    clean_env.setenv("EXTKERNELS_SMALL", "1")
    prob = extkernels.problem()
    assert prob.small is True
    # The sizes the module documents for CPU runs: 4,000 reference points, 12^3 queries.
    assert (prob.n_ref, prob.n_ref_radius, prob.grid_side) == (4_000, 4_000, 12)
    assert prob.n_query == 12**3


def test_problem_small_flag_shrinks_sizes_even_with_a_gpu(clean_env):
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    full = extkernels.problem()
    clean_env.setenv("EXTKERNELS_SMALL", "1")
    small = extkernels.problem()
    assert full.small is False and small.small is True
    assert small.device.type == "cuda"
    assert small.n_ref < full.n_ref and small.n_ref_radius < full.n_ref_radius
    assert small.grid_side < full.grid_side


def test_problem_without_gpu_picks_the_cpu(clean_env):
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    prob = extkernels.problem()
    assert prob.device == torch.device("cpu")
    assert prob.small is True
    assert prob.hardware == "CPU"


def test_problem_device_env_forces_the_cpu(clean_env):
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setenv("EXTKERNELS_DEVICE", "cpu")
    assert extkernels.problem().device == torch.device("cpu")


def test_problem_with_sizes_returns_a_changed_copy():
    prob = extkernels.problem()
    changed = prob.with_sizes(n_ref=123, grid_side=3)
    assert (changed.n_ref, changed.grid_side, changed.n_query) == (123, 3, 27)
    assert prob.n_ref != 123
    assert changed.k == prob.k and changed.device == prob.device


def test_fixed_gather_takes_one_reference_row_per_query_and_passes_gradients():
    feats = torch.randn(10, 4, requires_grad=True)
    agg = extkernels.FixedGather(n_query=7, n_ref=10, seed=3)
    out = agg(torch.zeros(7, 3), torch.zeros(10, 3), feats)
    assert torch.equal(out, feats.detach()[agg.index])
    assert torch.equal(agg.index, extkernels.FixedGather(7, 10, seed=3).index)
    out.sum().backward()
    counts = torch.bincount(agg.index, minlength=10).float()
    assert torch.equal(feats.grad, counts[:, None].expand(10, 4))
