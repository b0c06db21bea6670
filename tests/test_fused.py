"""The fused backend's own choices (chapter 11), beyond the conformance suite: every
number of threads per query finds chapter 9's neighbours, both radius kernels agree, and
a bad ``lanes`` is refused by the operator and by its fake, and the schemas' default
``lanes`` is the package's."""

import pandas as pd
import pytest
import torch
from conftest import DEVICES
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

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
    with pytest.raises(ValueError, match="^lanes: expected 1, 4, 8, 16 or 32") as real:
        torch.ops.extkernels_fused.knn(p_query, p_ref, 3, lanes)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match="^lanes:") as fake:
        torch.ops.extkernels_fused.knn(
            mode.from_tensor(p_query), mode.from_tensor(p_ref), 3, lanes
        )
    # both messages come from build.LANES: the C++ one through the compiler's defines
    assert str(real.value).splitlines()[0] == str(fake.value).splitlines()[0]


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
def test_the_lanes_table_has_float_times_and_finds_the_same_neighbours():
    from extkernels.experiments import whole_step

    fused.prepare()
    p_query, p_ref = _clouds("cuda")
    feats = torch.randn(p_ref.shape[0], 8, device="cuda")
    t = whole_step.lanes_table(p_query, p_ref, feats, 7, 0.1, (1, 4), n_iters=3)
    assert [str(t[c].dtype) for c in ("ms", "min", "max")] == ["float64"] * 3
    assert t["same neighbours"].all()


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
@pytest.mark.parametrize("n_ball", [300, 700, 3000])
def test_dense_neighbourhoods_sum_to_the_reference_on_every_call(
    n_feats, dtype, n_ball
):
    """Queries inside a ball of hundreds to thousands of points much narrower than the
    radius have boxes of as many points (rows of up to 32 features go to the dense
    kernel, whose teams of 2, 4 or 8 warps grow with the box; wider rows stay with the
    warp walk); queries far from it have a few dozen. Both sum to the brute force, and
    twice the same call gives the same bits."""
    fused.prepare()
    g = torch.Generator().manual_seed(3)
    ball = 0.02 * torch.randn(n_ball, 3, generator=g)
    p_ref = torch.cat([ball, ek.reference_cloud(2000, seed=1)]).cuda()
    p_query = torch.cat([0.03 * torch.randn(200, 3, generator=g), ek.query_grid(8)])
    p_query = p_query.cuda()
    feats = torch.randn(p_ref.shape[0], n_feats, device="cuda", dtype=dtype)
    op = torch.ops.extkernels_fused.radius_aggregate_fwd
    out, totals = op(p_query, p_ref, feats, 0.3, 0.1, True)[:2]
    again = op(p_query, p_ref, feats, 0.3, 0.1, True)[0]
    assert torch.equal(out, again)
    assert (totals[:200] > n_ball / 3 * torch.exp(torch.tensor(-0.3 / 0.1))).all()
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


@pytest.mark.parametrize("offset", [0.0, 1.0e4])
def test_the_tree_never_skips_a_nearer_point_above_a_tilted_plane(offset):
    """Points on a tilted plane (far from the origin too, where float32 rounds them
    into a staircase) queried from heights of 1e-4 to 10 on both sides: the tree finds
    the grid's neighbours (the two round a distance differently in the last bit, so
    near ties may swap places)."""
    fused.prepare()
    g = torch.Generator().manual_seed(0)
    normal = torch.tensor([0.3, -0.5, 1.0])
    normal = normal / normal.norm()
    e1 = torch.linalg.cross(normal, torch.tensor([1.0, 0.0, 0.0]))
    e1 = e1 / e1.norm()
    e2 = torch.linalg.cross(normal, e1)
    uv = torch.rand(6000, 2, generator=g) * 2 - 1
    p_ref = (uv[:, :1] * e1 + uv[:, 1:] * e2 + offset).contiguous()
    heights = torch.logspace(-4, 1, 40).repeat(2) * torch.tensor(
        [1.0, -1.0]
    ).repeat_interleave(40)
    at = torch.rand(80, 2, generator=g) * 2 - 1
    p_query = at[:, :1] * e1 + at[:, 1:] * e2 + heights[:, None] * normal + offset
    p_query = p_query.contiguous()
    d_tree, i_tree = torch.ops.extkernels_fused.knn(p_query, p_ref, 7, 8, "tree")
    d_grid, i_grid = torch.ops.extkernels_fused.knn(p_query, p_ref, 7, 8, "grid")
    assert torch.equal(i_tree.sort(1).values, i_grid.sort(1).values)
    torch.testing.assert_close(d_tree, d_grid, rtol=1e-6, atol=0.0)


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
@pytest.mark.parametrize("n_ref", [3000, 25_000])
@pytest.mark.parametrize("name", ["normal", "outlier", "slab", "clusters"])
def test_the_cuda_grid_has_the_cpu_grids_box_and_cells(name, n_ref):
    """The CUDA build reduces the box and the spread in blocks, then adds the blocks'
    sums with warps (12 blocks at 3,000 points, 64 at 25,000); the CPU build adds the
    points one by one. Both give the same box and the same cells, and cell sides equal
    to float rounding (a tiny radius: the spread, not the radius, sizes the cells)."""
    from extkernels import clouds

    fused.prepare()
    w = clouds.workload(name, n_ref, side=4)
    feats = torch.ones(w.p_ref.shape[0], 1)
    fwd = torch.ops.extkernels_fused.radius_aggregate_fwd
    args = (w.p_query, w.p_ref, feats)
    cpu = fwd(*args, 1e-6, 0.1, True)[4].view(torch.float32)
    gpu = fwd(*(x.cuda() for x in args), 1e-6, 0.1, True)[4].cpu().view(torch.float32)
    # GridParams: lo[3], h, inv_h, dims[3] (int32)
    assert torch.equal(gpu[:3], cpu[:3])
    torch.testing.assert_close(gpu[3:5], cpu[3:5], rtol=1e-6, atol=0)
    assert torch.equal(gpu[5:8].view(torch.int32), cpu[5:8].view(torch.int32))
    assert cpu[3] > 1e-6  # sized by the spread


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["clusters", "spitfire"])
def test_the_dense_queries_kernel_gives_the_cpu_kernels_sums(name):
    """Beside a tight cluster or a densely sampled surface a query's box holds hundreds
    to thousands of points, and the CUDA forward hands it to a kernel of its own (the
    CPU kernel walks every query alike). Both give the same sums on every query, except
    where a point lies within float32 rounding of the radius: there the two builds may
    round its distance to either side."""
    from extkernels import clouds

    fused.prepare()
    w = clouds.workload(name, 25_000, side=20)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(w.p_ref.shape[0], 25, generator=g)
    args = (w.p_query, w.p_ref, feats)
    fwd = torch.ops.extkernels_fused.radius_aggregate_fwd
    gpu, gpu_totals, *_ = fwd(*(x.cuda() for x in args), 0.1, 0.1, True)
    cpu, cpu_totals, *_ = fwd(*args, 0.1, 0.1, True)
    d = torch.cdist(w.p_query.double(), w.p_ref.double())
    clear = ~((d - 0.1).abs() < 1e-5).any(1)
    dense = (d <= 0.1).sum(1) > 256
    assert (dense & clear).sum() > 20  # the dense kernel's queries are compared
    torch.testing.assert_close(gpu.cpu()[clear], cpu[clear], rtol=1e-4, atol=1e-5)
    totals = gpu_totals.cpu()[clear], cpu_totals[clear]
    torch.testing.assert_close(*totals, rtol=1e-4, atol=0)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_queries_too_long_for_one_warp_are_finished_exactly_and_alike_every_call():
    """Near the centre of a hollow shell some walks take hundreds of steps (the CPU
    replay shows them), more than one warp is given before a team of warps takes the
    query over: the search stays exact, two calls return the same neighbours, and the
    aggregation is the softmax-weighted sum over them. (Not compared with the grid's:
    two points may lie at the same float32 distance, and either may be the seventh; on
    this cloud one query's are 4300 and 92168.)"""
    from extkernels import clouds, reference

    fused.prepare()
    w = clouds.workload("shell", 100_000, side=12)
    work = fused.knn_work(w.p_query, w.p_ref, 7, index="tree").double()
    steps = work.sum(1) / 32  # a step tests a node's 32 children or 32 points
    assert steps.max() > 256, steps.max()
    q, p = w.p_query.cuda(), w.p_ref.cuda()
    d, i = torch.ops.extkernels_fused.knn(q, p, 7, 8, "tree")
    assert reference.validate_knn(q, p, d, i, 7, atol=1e-5)
    again = torch.ops.extkernels_fused.knn(q, p, 7, 8, "tree")
    assert torch.equal(i, again[1]) and torch.equal(d, again[0])
    feats = torch.randn(p.shape[0], 25, device="cuda")
    tree = torch.ops.extkernels_fused.knn_aggregate_fwd(q, p, feats, 7, 0.1, 8, "tree")
    expected = (torch.softmax(-d / 0.1, 1)[..., None] * feats[i]).sum(1)
    torch.testing.assert_close(tree[0], expected, rtol=1e-5, atol=1e-6)


def test_the_tree_search_is_exact_on_every_cloud():
    from extkernels import clouds, reference

    for name in clouds.GEOMETRIES:
        w = clouds.workload(name, 3000, side=6)
        d, i = torch.ops.extkernels_fused.knn(w.p_query, w.p_ref, 7)
        assert reference.validate_knn(w.p_query, w.p_ref, d, i, 7, atol=1e-5), name


# ------------------------------------------------------- chapter 11's experiments


def test_projector_builds_the_same_seeded_model_for_each_workload(small_problem):
    from extkernels.experiments import whole_step

    prob = small_problem
    for workload, n_ref in (("knn", prob.n_ref), ("radius", prob.n_ref_radius)):
        model, p_ref, target = whole_step.projector(workload, prob)
        again, _, _ = whole_step.projector(workload, prob)
        assert p_ref.shape == (n_ref, 3) and target.shape == (prob.n_query, 1)
        for a, b in zip(model.parameters(), again.parameters(), strict=True):
            assert torch.equal(a, b)
        agg = model.aggregation
        assert isinstance(
            agg, ek.KnnAggregation if workload == "knn" else ek.RadiusAggregation
        )
    with pytest.raises(ValueError, match='^workload: expected "knn" or "radius"'):
        whole_step.projector("ball", prob)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_steps_and_the_reduce_overhead_row_measure_both_workloads(
    small_problem,
):
    from extkernels.experiments import whole_step, whole_step_report

    prob = small_problem.with_sizes(device=torch.device("cuda"))
    p_query = ek.query_grid(prob.grid_side, device="cuda")
    steps, kernels, rows = {}, {}, {}
    for workload in ("knn", "radius"):
        model, cloud, target = whole_step.projector(workload, prob)
        steps[workload], kernels[workload] = whole_step.captured_steps(
            model, p_query, cloud, target, n_iters=5
        )
        model, cloud, target = whole_step.projector(workload, prob)
        rows[workload] = whole_step.reduce_overhead_row(model, p_query, cloud, target)
    steps = pd.concat(steps)
    assert list(steps.columns) == ["ms", "min", "max"] and (steps["ms"] > 0).all()
    quotes = whole_step_report.replay_quotes(steps, kernels)
    assert 0 < quotes["knn_agg_share"] < 100
    ro = whole_step_report.reduce_overhead_quotes(pd.DataFrame(rows).T)
    assert ro["ro_whole_graphs"] >= 1


def test_the_benchmark_rows_keep_the_chapters_order_and_skip_missing_ones():
    from extkernels.experiments import whole_step_report as report

    bench = pd.DataFrame(
        {"forward_ms": [0.2, 0.1, 0.3], "train_ms": [0.5, 0.3, 0.6]},
        index=["radius/fused+graphs", "knn/floor+graphs", "knn/fused"],
    )
    assert list(report.benchmark_rows(bench).index) == [
        "knn/fused",
        "knn/floor+graphs",
        "radius/fused+graphs",
    ]
    quotes = report.benchmark_quotes(bench, ["radius/fused+graphs", "knn/absent"])
    assert quotes == {"radius_fused_graphs_fwd": 0.2, "radius_fused_graphs_train": 0.5}


def test_the_lanes_and_radius_quotes_read_the_right_rows():
    from extkernels.experiments import whole_step_report as report

    lanes = pd.DataFrame(
        {
            "ms": [0.10, 0.19, 0.12, 0.13],
            "min": [0.09, 0.18, 0.11, 0.12],
            "max": [0.105, 0.20, 0.13, 0.14],
            "same neighbours": True,
        },
        index=["chapter 9", "1", "4", "8"],
    )
    quotes = report.lanes_quotes(lanes)  # chapter 9's row is never the best group
    assert quotes["best_lanes"] == "4" and quotes["best_lanes_ms"] == 0.12
    assert quotes["cpp_agg_ms"] == 0.10 and len(quotes) == 3
    walks = pd.DataFrame(
        {"forward ms": [0.1, 0.08], "backward ms": [0.03, 0.06]},
        index=["a warp per query", "a thread per feature"],
    )
    assert report.radius_quotes(walks) == pytest.approx({"warp_gain_bwd": 2.0})


def test_the_replay_quotes_share_the_kernels_by_their_names():
    from extkernels.experiments import whole_step_report as report

    steps = pd.concat(
        {
            "knn": pd.DataFrame(
                {"ms": [0.59, 0.56], "min": [0.58, 0.55], "max": [0.60, 0.57]},
                index=["eager", "compiled"],
            )
        }
    )
    kernels = {
        "knn": pd.DataFrame(
            {
                "kernel": ["extkernels::", "cutlass::Kernel2", "sm80_xmma_gemm", "x"],
                "share (%)": [30.0, 20.0, 10.0, 40.0],
            }
        )
    }
    quotes = report.replay_quotes(steps, kernels)
    assert quotes == {"knn_agg_share": 30.0}


def test_the_shapes_quotes_read_the_first_size_and_the_first_change():
    from extkernels.experiments import whole_step_report as report

    strategies = [
        "compiled",
        "compiled, mark_dynamic",
        "one graph per size",
        "one graph, padded to 131,072",
    ]
    sizes = [100_000, 90_000, 120_000, 100_000]  # the last call repeats the first size
    index = pd.MultiIndex.from_tuples(
        [(s, call, n) for s in strategies for call, n in enumerate(sizes, 1)],
        names=["strategy", "call", "points"],
    )
    shapes = pd.DataFrame(
        {
            "first call ms": range(len(index)),
            "ms per call": [0.1 * i for i in range(len(index))],
        },
        index=index,
    ).astype(float)
    quotes = report.shapes_quotes(shapes)
    assert quotes == pytest.approx({"recapture_ms": 9.0})


def test_the_precision_and_reduce_overhead_quotes():
    from extkernels.experiments import whole_step_report as report

    half = pd.DataFrame(
        {"ms": [0.25, 0.20], "relative error": [0.0, 4e-4]},
        index=["float32", "float16"],
    )
    assert report.half_quotes(half) == {"half_error": 4e-4}
    ro = pd.DataFrame(
        {"ms per step": [1.4, 1.5], "graph launches": [3.0, 3.0]},
        index=["knn", "radius"],
    )
    assert report.reduce_overhead_quotes(ro) == {"ro_whole_graphs": 3.0}
    steps = pd.DataFrame(
        {"ms": [0.8, 0.7, 0.6, 0.5]},
        index=pd.MultiIndex.from_product(
            [["knn", "radius"], ["eager", "compiled"]],
            names=["workload", "model in the graph"],
        ),
    )
    quotes = report.reduce_overhead_quotes(ro, steps)
    assert quotes["ro_over_by_hand_knn"] == pytest.approx(2.0)
    assert quotes["ro_over_by_hand_radius"] == pytest.approx(3.0)


def test_the_fakes_grid_has_the_librarys_layout():
    """The fakes size the grid from the library's own ``grid_layout``: the radius
    forward's real outputs and its fake's agree on the cell starts and parameters."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from extkernels.ops.fused import ops

    q, r, f = ek.query_grid(4), ek.reference_cloud(50), ek.features(50, 5)
    real = torch.ops.extkernels_fused.radius_aggregate_fwd(q, r, f, 0.5, 0.1)
    with FakeTensorMode() as mode:
        fake = torch.ops.extkernels_fused.radius_aggregate_fwd(
            *(mode.from_tensor(t) for t in (q, r, f)), 0.5, 0.1
        )
    assert [t.shape for t in fake] == [t.shape for t in real]
    assert real[4].numel() == ops.grid_params_bytes()
    assert (
        real[3].numel() == ops.cell_capacity(50) + 1 == ops.cells_per_point() * 50 + 1
    )


# ---------------------------------------------------------- the search into buffers


@pytest.mark.parametrize("device", DEVICES)
def test_knn_out_writes_the_searchs_result_into_the_buffers(device):
    fused.prepare()
    p_query, p_ref = _clouds(device)
    m = p_query.shape[0]
    distances = torch.full((m, 7), float("nan"), device=device)
    indices = torch.full((m, 7), -1, dtype=torch.int64, device=device)
    fused.knn_out(p_query, p_ref, 7, distances, indices)
    want_d, want_i = torch.ops.extkernels_fused.knn(p_query, p_ref, 7)
    assert torch.equal(distances, want_d) and torch.equal(indices, want_i)
    opcheck(
        torch.ops.extkernels_fused.knn_out.default,
        (p_query, p_ref, 7, distances, indices),
    )


@pytest.mark.parametrize(
    "change, error",
    [
        (lambda d: d.double(), "distances: expected dtype torch.float32"),
        (lambda d: d[:, :6].contiguous(), r"distances: expected shape \(\d+, 7\)"),
        (lambda d: d.t().contiguous().t(), "distances: expected a contiguous tensor"),
    ],
    ids=["dtype", "shape", "layout"],
)
def test_knn_out_refuses_a_wrong_buffer_in_the_entry_the_operator_and_the_fake(
    change, error
):
    fused.prepare()
    p_query, p_ref = _clouds("cpu")
    m = p_query.shape[0]
    distances = change(torch.empty(m, 7))
    indices = torch.empty(m, 7, dtype=torch.int64)
    args = (p_query, p_ref, 7, distances, indices)
    with pytest.raises((TypeError, ValueError), match=error):
        fused.knn_out(*args)
    with pytest.raises((TypeError, ValueError), match=error):
        torch.ops.extkernels_fused.knn_out(*args)
    if "contiguous" not in error:  # a fake does not ask for a layout (checks.py)
        with FakeTensorMode() as mode, pytest.raises((TypeError, ValueError)):
            torch.ops.extkernels_fused.knn_out(
                *(
                    mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                    for a in args
                )
            )


def test_knn_out_compiles_whole_and_exports_as_a_mutation():
    fused.prepare()
    p_query, p_ref = _clouds("cpu")
    m = p_query.shape[0]

    class Search(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("distances", torch.zeros(m, 7))
            self.register_buffer("indices", torch.zeros(m, 7, dtype=torch.int64))

        def forward(self, p_query, p_ref):
            torch.ops.extkernels_fused.knn_out(
                p_query, p_ref, 7, self.distances, self.indices
            )
            return self.distances.sum(dim=1)

    want = torch.ops.extkernels_fused.knn(p_query, p_ref, 7)[0].sum(dim=1)
    compiled = torch.compile(Search(), fullgraph=True)
    torch.testing.assert_close(compiled(p_query, p_ref), want)
    ep = torch.export.export(Search(), (p_query, p_ref)).run_decompositions()
    # functionalised: the operator runs on copies, and the buffers are outputs
    assert any("auto_functionalized" in str(n.target) for n in ep.graph.nodes)
    assert set(ep.graph_signature.buffers_to_mutate.values()) == {
        "distances",
        "indices",
    }
    torch.testing.assert_close(ep.module()(p_query, p_ref), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_in_one_graph_inductor_keeps_each_bias_inside_the_matrix_product():
    from torch._inductor.utils import run_and_get_code

    from extkernels.variants import IN_ONE_GRAPH

    prob = ek.problem()
    p_ref = ek.reference_cloud(prob.n_ref, seed=0, device="cuda")
    p_query = ek.query_grid(prob.grid_side, device="cuda")
    agg = ek.KnnAggregation(prob.k, prob.sigma, "fused")
    model = ek.Projector(agg, prob.hidden).cuda()
    code = {}
    for label, options in (("defaults", {}), ("one graph", IN_ONE_GRAPH)):
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, options=options or None)
        _, sources = run_and_get_code(compiled, p_query, p_ref)
        code[label] = "\n".join(sources)
    # the default splits the bias out of each product followed by a ReLU, to add it in
    # the ReLU's kernel; a product whose output goes elsewhere keeps it either way
    fused_bias = {
        label: text.count("extern_kernels.addmm") for label, text in code.items()
    }
    assert "extern_kernels.mm(" in code["defaults"]
    assert fused_bias["one graph"] >= fused_bias["defaults"] + 4  # the four ReLUs'
