"""The projector on several ranks (chapter 13): shard arithmetic, partial sums that add
up to the aggregation, and 2, 3 or 4 CPU processes over gloo against one process,
forward and gradients."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import N_FEATS, N_REF
from torch.multiprocessing import ProcessRaisedException

import extkernels as ek
from extkernels.distributed import ShardedProjector, knn_partial, radius_partial
from extkernels.distributed import shards as S
from extkernels.distributed.command import bench, checks
from extkernels.distributed.exactness import same_neighbours, within_float32
from extkernels.distributed.ops import sharded_knn
from extkernels.distributed.setups import make_setup, single_projector
from extkernels.ops.gather import softmax_gather

SIGMA, RADIUS = 0.1, 0.18


# ----------------------------------------------------------------- rows of each rank


@pytest.mark.parametrize("n, world", [(10, 3), (7, 7), (1000, 4), (5, 2)])
def test_reference_shards_cover_the_cloud_once_and_balance(n, world):
    rows = [S.reference_rows(n, world, r) for r in range(world)]
    covered = [i for r in rows for i in range(r.lo, r.hi)]
    assert covered == list(range(n))
    sizes = [r.size for r in rows]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


@pytest.mark.parametrize("m, world", [(8, 3), (1, 2), (27, 4), (12, 12)])
def test_query_chunks_cover_the_queries_once(m, world):
    rows = [S.query_rows(m, world, r) for r in range(world)]
    assert [i for r in rows for i in range(r.lo, r.hi)] == list(range(m))
    chunk = -(-m // world)
    assert all(r.lo == min(i * chunk, m) for i, r in enumerate(rows))


def test_rows_name_what_is_wrong():
    with pytest.raises(ValueError, match="p_ref: expected at least one point per rank"):
        S.reference_rows(2, 3, 0)
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < world=2"):
        S.query_rows(10, 2, 2)
    with pytest.raises(ValueError, match="x: expected 10 rows, got 9"):
        S.query_rows(10, 2, 0).of(torch.zeros(9, 3))


# ------------------------------------------------ partial sums, in one process


def _shards(n, world=3):
    return [S.reference_rows(n, world, r) for r in range(world)]


def test_knn_partials_of_the_shards_add_up_to_the_aggregation(p_query, p_ref, feats):
    d, i = ek.knn(p_query, p_ref, 7)
    total = sum(knn_partial(d, i, r.of(feats), SIGMA, r) for r in _shards(N_REF))
    torch.testing.assert_close(total, softmax_gather(d, i, feats, SIGMA))


def test_knn_partial_is_differentiable_in_the_shard_features(p_query, p_ref):
    d, i = ek.knn(p_query, p_ref, 7)
    rows = _shards(N_REF)[1]
    f = torch.randn(rows.size, N_FEATS, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda f: knn_partial(d.double(), i, f, SIGMA, rows), (f,)
    )


@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_radius_partials_of_the_shards_add_up_to_the_aggregation(
    backend, p_query, p_ref, feats
):
    if backend not in ek.backends("radius_aggregate"):
        pytest.skip(f"{backend} does not run here")
    far = torch.cat([p_query, torch.full((1, 3), 10.0)])  # a query with no neighbour
    total = sum(
        radius_partial(far, r.of(p_ref), r.of(feats), RADIUS, SIGMA, backend=backend)
        for r in _shards(N_REF)
    )
    weights = total[:, -1:]
    out = torch.where(weights > 0, total[:, :-1] / weights.clamp_min(1e-38), 0.0)
    want = ek.radius_aggregate(far, p_ref, feats, RADIUS, SIGMA)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert weights[-1].item() == 0 and (out[-1] == 0).all()


def test_radius_partial_names_what_is_wrong(p_query, p_ref, feats):
    with pytest.raises(ValueError, match="radius"):
        radius_partial(p_query, p_ref, feats, 0.0, SIGMA, backend="torch")
    with pytest.raises(ValueError, match="backend: expected 'fused' or 'torch'"):
        radius_partial(p_query, p_ref, feats, RADIUS, SIGMA, backend="warp")
    bad = p_ref.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="p_ref"):
        radius_partial(p_query, bad, feats, RADIUS, SIGMA, backend="torch")


# -------------------------------------------- one rank, in this process (gloo)


@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_one_shard_searches_like_the_whole_cloud(one_rank, p_query, p_ref):
    rows = S.reference_rows(N_REF, 1, 0)
    got = sharded_knn(p_query, p_ref, 7, rows, backend="torch")
    want = ek.knn(p_query, p_ref, 7)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0])


def test_sharded_search_names_what_is_wrong(one_rank, p_query, p_ref):
    rows = S.reference_rows(N_REF, 1, 0)
    with pytest.raises(ValueError, match=f"p_ref: expected this rank's {N_REF}"):
        sharded_knn(p_query, p_ref[:-1], 7, rows)
    with pytest.raises(ValueError, match=f"k: expected 1 <= k <= {N_REF}"):
        sharded_knn(p_query, p_ref, N_REF + 1, rows)
    with pytest.raises(ValueError, match="k: expected 1 <= k"):
        sharded_knn(p_query, p_ref, 0, rows)
    with pytest.raises(TypeError, match="p_query: expected dtype torch.float32"):
        sharded_knn(p_query.double(), p_ref, 7, rows)


@pytest.mark.parametrize("workload", ["knn", "radius"])
def test_a_sharded_projector_of_one_rank_is_the_projector(one_rank, workload, p_query):
    prob = ek.problem().with_sizes(n_ref=N_REF, n_ref_radius=N_REF)
    torch.manual_seed(0)
    whole = single_projector(workload, prob, "torch")
    sharded = ShardedProjector(workload, N_REF, radius=prob.radius, backend="torch")
    sharded.load_state_dict(whole.state_dict())
    p_ref = ek.reference_cloud(N_REF, seed=0)
    torch.testing.assert_close(sharded(p_query, p_ref), whole(p_query, p_ref))


def test_layouts_and_workloads_are_named(one_rank):
    prob = ek.problem()
    with pytest.raises(ValueError, match="layout: expected one of"):
        make_setup("knn", "pipeline", prob, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="workload: expected 'knn' or 'radius'"):
        ShardedProjector("ball", 100)


def test_float32_rounding_is_told_from_a_wrong_result():
    assert within_float32(2e-8, 0.02)
    assert not within_float32(1e-3, 0.02)


# ------------------------------------- several CPU processes, against one process


@pytest.fixture(scope="module")
def two_ranks():
    return checks(2, device="cpu")


def _rows(df):
    return [row for _, row in df.iterrows()]


@pytest.mark.slow
@pytest.mark.parametrize("i", range(4))
def test_two_ranks_match_one_process(two_ranks, i):
    row = two_ranks.iloc[i]
    assert row["world"] == 2
    assert within_float32(row["forward"], row["forward_scale"]), row.to_dict()
    assert within_float32(row["grad"], row["grad_scale"]), row.to_dict()
    assert within_float32(row["weights"], 1.0), row.to_dict()
    if row["workload"] == "knn" and row["layout"] == "reference":
        assert row["same_neighbours"] is True


def _every_layout_matches_one_process(df, world):
    """Every (workload, layout) of ``checks`` on ``world`` ranks: forward and gradients
    within float32 rounding of one process, the kNN reference layout's neighbours the
    same."""
    assert len(df) == 4 and (df["world"] == world).all()
    for row in _rows(df):
        assert within_float32(row["forward"], row["forward_scale"]), row.to_dict()
        assert within_float32(row["grad"], row["grad_scale"]), row.to_dict()
    knn_ref = df[(df["workload"] == "knn") & (df["layout"] == "reference")]
    assert knn_ref["same_neighbours"].tolist() == [True]


@pytest.mark.slow
def test_three_ranks_with_shards_smaller_than_k_match_one_process():
    # 10 points over 3 ranks (3, 3 and 4 points, fewer than k = 7) and 8 queries (chunks
    # of 3, 3 and 2)
    _every_layout_matches_one_process(checks(3, n_ref=10, grid_side=2, device="cpu"), 3)


@pytest.mark.slow
def test_four_ranks_match_one_process_and_the_command_times_them():
    # chapter 13's largest layout: every (workload, layout) on 4 gloo ranks against one
    # process, then the scaling command's 4-rank path
    _every_layout_matches_one_process(
        checks(4, n_ref=400, grid_side=4, device="cpu"), 4
    )
    result = bench(
        4,
        workloads=("radius",),
        layouts=("queries",),
        sizes=[400],
        grid_side=4,
        repeats=1,
        blocks=1,
        device="cpu",
    )
    assert sorted(r["world"] for r in result["runs"]) == [1, 4]
    assert all(r["forward_ms"] > 0 and r["train_ms"] > 0 for r in result["runs"])


@pytest.mark.slow
def test_compiled_ranks_match_one_process():
    df = checks(2, layouts=("reference",), compile=True, device="cpu")
    assert df["compiled"].all() and len(df) == 2
    for row in _rows(df):
        assert within_float32(row["forward"], row["forward_scale"]), row.to_dict()
        assert within_float32(row["grad"], row["grad_scale"]), row.to_dict()


@pytest.mark.slow
def test_an_error_on_the_ranks_reaches_the_caller_with_its_argument():
    with pytest.raises(ProcessRaisedException, match="p_ref: expected at least one"):
        checks(2, n_ref=1, workloads=("knn",), layouts=("reference",), device="cpu")


@pytest.mark.slow
def test_the_scaling_command_times_every_world_layout_and_size():
    result = bench(
        2,
        workloads=("knn",),
        sizes=[300, 600],
        repeats=1,
        profile_steps=2,
        blocks=1,
        device="cpu",
    )
    seen = {(r["layout"], r["world"], r["n_ref"]) for r in result["runs"]}
    want = {("single", 1), ("queries", 1), ("reference", 1), ("queries", 2)}
    want |= {("reference", 2)}
    assert seen == {(layout, w, n) for layout, w in want for n in (300, 600)}
    assert all(r["forward_ms"] > 0 and r["train_ms"] > 0 for r in result["runs"])
    profiles = {(p["layout"], p["world"]): p for p in result["profiles"]}
    assert set(profiles) == {("single", 1), ("reference", 1), ("reference", 2)}
    assert {p["n_ref"] for p in profiles.values()} == {600}
    assert 0 < profiles["reference", 2]["comm_share"] < 1
    assert profiles["single", 1]["comm_share"] == 0  # no process group, no collective
    for p in profiles.values():
        *each, total = p["parts"].values()
        assert total == pytest.approx(sum(each)) and all(t >= 0 for t in each)
        assert (
            p["parts"]["matrix products"] > 0 and p["parts"]["the book's kernels"] > 0
        )


@pytest.mark.slow
def test_the_command_runs_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", "2", "-m", "extkernels.distributed", "check"]
    cmd += ["--workloads", "knn", "--layouts", "reference", "--device", "cpu"]
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout.strip().splitlines()
    assert len(table) == 2 and "reference" in table[1] and "True" in table[1]


# ------------------------------------------------------ GPUs, one rank each (NCCL)


def _gpu_world() -> int:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return min(torch.cuda.device_count(), 4)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_nccl_ranks_match_one_gpu(compiled):
    world = _gpu_world()
    layouts = ("reference",) if compiled else ("queries", "reference")
    df = checks(world, layouts=layouts, compile=compiled, device="cuda")
    assert (df["world"] == world).all() and len(df) == 2 * len(layouts)
    for row in _rows(df):
        assert within_float32(row["forward"], row["forward_scale"]), row.to_dict()
        assert within_float32(row["grad"], row["grad_scale"]), row.to_dict()
        if row["workload"] == "knn" and row["layout"] == "reference":
            assert row["same_neighbours"] is True


def test_neighbours_are_the_same_up_to_ties():
    q = torch.zeros(1, 3)
    # points 1 to 5 at distances 0.1, 0.2, 0.3, 0.3 and 0.5 from the query
    r = torch.tensor([[9.0, 0, 0], [0.1, 0, 0], [0, 0.2, 0], [0, 0, 0.3]])
    r = torch.cat([r, torch.tensor([[0, -0.3, 0], [0.5, 0, 0]])])
    want = torch.tensor([[0.1, 0.2, 0.3]]), torch.tensor([[1, 2, 3]])
    assert same_neighbours(want, want, q, r)
    assert same_neighbours(want, (want[0], torch.tensor([[1, 2, 4]])), q, r)  # tie
    assert not same_neighbours(want, (want[0], torch.tensor([[1, 2, 5]])), q, r)
    assert not same_neighbours(want, (want[0] + 1e-3, want[1]), q, r)
