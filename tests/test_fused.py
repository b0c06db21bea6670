"""The fused backend's own choices (chapter 11), beyond the conformance suite: every
number of threads per query finds chapter 9's neighbours, both radius kernels agree, and
a bad ``lanes`` is refused by the operator and by its fake, and the schemas' default
``lanes`` is the package's."""

import pytest
import torch
from conftest import DEVICES
from torch._subclasses.fake_tensor import FakeTensorMode

import extkernels as ek
from extkernels.ops import fused

pytestmark = pytest.mark.skipif(not fused.available(), reason="needs a C++ compiler")


def _clouds(device, n_ref=3000, side=10, seed=0):
    p_ref = ek.reference_cloud(n_ref, seed=seed, device=device)
    p_ref[: n_ref // 10] = p_ref[n_ref // 10 : n_ref // 5]  # duplicated points
    return ek.query_grid(side, device=device), p_ref


@pytest.mark.parametrize("lanes", [0, 3, 64])
def test_a_bad_lanes_is_refused_by_the_operator_and_its_fake(lanes):
    fused.prepare()
    p_query, p_ref = _clouds("cpu", n_ref=50, side=3)
    with pytest.raises(ValueError, match="^lanes: expected 1, 4, 8, 16 or 32"):
        torch.ops.extkernels_fused.knn(p_query, p_ref, 3, lanes)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match="^lanes:"):
        torch.ops.extkernels_fused.knn(
            mode.from_tensor(p_query), mode.from_tensor(p_ref), 3, lanes
        )


@pytest.mark.parametrize("name", ["knn", "knn_aggregate_fwd"])
def test_the_schemas_defaults_are_the_packages(name):
    fused.prepare()
    schema = getattr(torch.ops.extkernels_fused, name).default._schema
    defaults = {a.name: a.default_value for a in schema.arguments}
    assert defaults["lanes"] == fused.DEFAULT_LANES
    assert defaults["index"] == fused.DEFAULT_INDEX


def test_a_bad_index_is_refused_by_the_operator_and_its_fake():
    fused.prepare()
    p_query, p_ref = _clouds("cpu")
    with pytest.raises(ValueError, match='^index: expected "tree" or "grid"'):
        torch.ops.extkernels_fused.knn(p_query, p_ref, 3, 4, "kd")
    with FakeTensorMode() as mode, pytest.raises(ValueError, match="^index:"):
        torch.ops.extkernels_fused.knn(
            mode.from_tensor(p_query), mode.from_tensor(p_ref), 3, 4, "kd"
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [1, 7, 16, 20])
def test_every_group_size_finds_chapter_9s_neighbours(k):
    fused.prepare()
    p_query, p_ref = _clouds("cuda")
    expected = torch.ops.extkernels_cpp.knn(p_query, p_ref, k)[0]
    for lanes in fused.LANES:
        got = torch.ops.extkernels_fused.knn(p_query, p_ref, k, lanes, "grid")[0]
        assert torch.equal(got, expected), f"lanes={lanes}, k={k}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n_feats", [5, 40, 130])
def test_both_radius_kernels_agree_forward_and_backward(n_feats):
    fused.prepare()
    p_query, p_ref = _clouds("cuda")
    feats = torch.randn(p_ref.shape[0], n_feats, device="cuda")
    grad = torch.randn(p_query.shape[0], n_feats, device="cuda")
    op = torch.ops.extkernels_fused.radius_aggregate_fwd
    bwd = torch.ops.extkernels_fused.radius_aggregate_bwd
    results = []
    for warp in (True, False):
        out, *saved = op(p_query, p_ref, feats, 0.3, 0.1, warp)
        results.append((out, bwd(grad, p_query, *saved, 0.3, 0.1, warp)))
    (a, ga), (b, gb) = results
    assert torch.allclose(a, b, atol=1e-5)
    assert torch.allclose(ga, gb, atol=1e-5)
    reference = ek.ops.torch.brute_force.radius_aggregate(
        p_query, p_ref, feats, 0.3, 0.1
    )
    assert torch.allclose(a, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n_feats", [1, 25, 32, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dense_neighbourhoods_sum_to_the_reference_on_every_call(n_feats, dtype):
    """Queries inside a ball of 3,000 points much narrower than the radius have boxes
    of thousands of points (rows of up to 32 features go to the dense kernel, wider
    ones stay with the warp walk); queries far from it have a few dozen. Both sum to
    the brute force, and twice the same call gives the same bits."""
    fused.prepare()
    g = torch.Generator().manual_seed(3)
    ball = 0.02 * torch.randn(3000, 3, generator=g)
    p_ref = torch.cat([ball, ek.reference_cloud(2000, seed=1)]).cuda()
    p_query = torch.cat([0.03 * torch.randn(200, 3, generator=g), ek.query_grid(8)])
    p_query = p_query.cuda()
    feats = torch.randn(p_ref.shape[0], n_feats, device="cuda", dtype=dtype)
    op = torch.ops.extkernels_fused.radius_aggregate_fwd
    out, totals = op(p_query, p_ref, feats, 0.3, 0.1, True)[:2]
    again = op(p_query, p_ref, feats, 0.3, 0.1, True)[0]
    assert torch.equal(out, again)
    assert (totals[:200] > 1000 * torch.exp(torch.tensor(-0.3 / 0.1))).all()
    reference = ek.ops.torch.brute_force.radius_aggregate(
        p_query, p_ref, feats.double(), 0.3, 0.1
    )
    torch.testing.assert_close(out.double(), reference, rtol=1e-4, atol=1e-5)


def _work_per_query(name: str, index: str) -> float:
    from extkernels import clouds

    w = clouds.workload(name, 4000, side=8)
    return float(
        fused.knn_work(w.p_query, w.p_ref, 7, index=index).sum(1).double().mean()
    )


def test_the_tree_does_the_same_work_on_every_cloud_where_the_grid_falls_off_a_cliff():
    """Boxes or cells looked into plus points tested, per query (chapter 14): the tree's
    stays within 1.5x of its work on the book's cloud on every geometry; the grid's
    grows more than fourfold on surfaces queried in the volume, clusters and an
    outlier."""
    from extkernels import clouds

    tree = {g: _work_per_query(g, "tree") for g in clouds.GEOMETRIES}
    grid = {g: _work_per_query(g, "grid") for g in clouds.GEOMETRIES}
    assert max(tree.values()) <= 1.5 * tree["normal"], tree
    for g in ("panda", "spitfire", "shell", "clusters", "outlier"):
        assert grid[g] >= 4 * grid["normal"], (g, grid)


def _beyond_the_box(device):
    """The outlier cloud, queried on its grid, next to the outlier, between it and the
    cloud, and beyond it: points outside a robust box (the radius walk's grid, the
    tree's Morton cube) must still be found."""
    from extkernels import clouds

    w = clouds.workload("outlier", 4000, side=6, device=device)
    far = w.p_ref[w.p_ref[:, 0].argmax()]
    extra = far + torch.tensor(
        [
            [0.0, 0.0, 0.0],
            [0.05, 0.1, 0.0],
            [-0.2, 0.0, 0.1],
            [5e3, 0.0, 0.0],
            [-5e3, 0.0, 0.0],
            [3e4, 2.0, -1.0],
        ],
        device=device,
    )
    return torch.cat([w.p_query, extra]), w.p_ref


@pytest.mark.parametrize("device", DEVICES)
def test_the_radius_walk_finds_points_beyond_the_grids_robust_box(device):
    fused.prepare()
    p_query, p_ref = _beyond_the_box(device)
    feats = torch.randn(p_ref.shape[0], 5, device=device)
    out = torch.ops.extkernels_fused.radius_aggregate_fwd(
        p_query, p_ref, feats, 0.3, 0.1, True
    )[0]
    reference = ek.ops.torch.brute_force.radius_aggregate(
        p_query, p_ref, feats, 0.3, 0.1
    )
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)
    assert out[-6:-4].abs().sum() > 0  # the queries at the outlier found it


@pytest.mark.parametrize("device", DEVICES)
def test_the_radius_grid_has_cells_as_wide_as_the_radius_on_tight_clusters(device):
    """On clusters far denser than the book's cloud, cells sized for two points each
    would make a box query +- radius walk thousands of cells; the radius walk's grid
    keeps them at least as wide as the radius, and the result stays exact."""
    from extkernels import clouds

    fused.prepare()
    w = clouds.workload("clusters", 4000, side=6, device=device)
    feats = torch.randn(w.p_ref.shape[0], 3, device=device)
    out, _, _, _, params = torch.ops.extkernels_fused.radius_aggregate_fwd(
        w.p_query, w.p_ref, feats, 0.1, 0.1, True
    )
    h = params.cpu().view(torch.float32)[3]  # GridParams: lo[3], h, inv_h, dims[3]
    assert h >= 0.1
    reference = ek.ops.torch.brute_force.radius_aggregate(
        w.p_query, w.p_ref, feats, 0.1, 0.1
    )
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("index", ["grid", "tree"])
def test_the_knn_search_finds_points_beyond_a_robust_box(index):
    from extkernels import reference

    fused.prepare()
    p_query, p_ref = _beyond_the_box("cuda")
    d, i = torch.ops.extkernels_fused.knn(p_query, p_ref, 7, 8, index)
    scale = float(p_query.abs().max())  # float32 rounding of distances near 10^4
    assert reference.validate_knn(p_query, p_ref, d, i, 7, atol=1e-6 * scale)
    assert (i[-6:-3] == p_ref[:, 0].argmax()).any(1).all()


def test_the_tree_search_is_exact_on_every_cloud():
    from extkernels import clouds, reference

    for name in clouds.GEOMETRIES:
        w = clouds.workload(name, 3000, side=6)
        d, i = torch.ops.extkernels_fused.knn(w.p_query, w.p_ref, 7)
        assert reference.validate_knn(w.p_query, w.p_ref, d, i, 7, atol=1e-5), name
