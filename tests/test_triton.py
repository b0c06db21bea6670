"""The Triton kNN kernels (chapter 8): exact against SciPy's k-d tree, run
by Triton's interpreter on CPU tensors where there is no GPU."""

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
cKDTree = pytest.importorskip("scipy.spatial").cKDTree

from test_position_grads import lattice, lowest_index_first  # noqa: E402

from extkernels.ops.triton import kernels, ops  # noqa: E402 (interpreter: conftest)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _clouds(kind: str, m: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, r = torch.randn(m, 3, generator=g), torch.randn(n, 3, generator=g)
    if kind == "offset":
        q, r = q + 1000.0, r + 1000.0
    elif kind == "clustered":
        r = torch.randn(4, 3, generator=g).repeat_interleave(n // 4 + 1, 0)[:n]
        r = r + 1e-3 * torch.randn(n, 3, generator=g)
    return q.to(DEVICE), r.to(DEVICE)


@pytest.mark.parametrize("grid", [False, True], ids=["brute", "grid"])
@pytest.mark.parametrize(
    "kind, m, n, k, cells",
    [
        ("random", 50, 300, 7, None),
        ("random", 37, 129, 3, 4),
        ("random", 5, 7, 7, None),
        ("random", 64, 1000, 1, None),
        ("offset", 40, 200, 7, None),
        ("clustered", 40, 200, 7, None),
        ("random", 40, 200, 7, 64),  # nearly empty cells: the brute-force restart
    ],
)
def test_search_is_exact(kind, m, n, k, cells, grid):
    q, r = _clouds(kind, m, n)
    d, i = ops.launch_knn(q, r, k, grid=grid, cells=cells)
    want_d, _ = cKDTree(r.double().cpu().numpy()).query(q.double().cpu().numpy(), k)
    want_d = torch.from_numpy(want_d).float().reshape(m, k)
    torch.testing.assert_close(d.cpu(), want_d, atol=1e-4, rtol=1e-5)
    # Every index lies at its distance (ties may pick either point).
    at = (q[:, None, :] - r[i]).norm(dim=-1)
    torch.testing.assert_close(at, d, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("grid, cells", [(False, None), (True, None), (True, 64)])
@pytest.mark.parametrize("k", [1, 7, 20])
def test_the_kernels_keep_the_lowest_index_of_equal_distances(k, grid, cells):
    """On the integer lattice many points lie at exactly equal distances: the kept
    lists, grid walk, brute force and the grid's brute-force restart (``cells=64``),
    of the search and of the fused kernel, hold the lowest reference indices."""
    p_query, p_ref = lattice()
    want = lowest_index_first(p_query, p_ref, k)
    q, r = p_query.to(DEVICE), p_ref.to(DEVICE)
    _, i = ops.launch_knn(q, r, k, grid=grid, cells=cells)
    np.testing.assert_array_equal(i.cpu().numpy(), want)
    # The fused kernel keeps the same lists, its indices in no particular order.
    feats = torch.ones(len(r), 2, device=DEVICE)
    *_, i = ops.launch_knn_aggregate(q, r, feats, k, 0.5, grid=grid, cells=cells)
    np.testing.assert_array_equal(
        np.sort(i.cpu().numpy(), axis=1), np.sort(want, axis=1)
    )


def test_queries_outside_the_reference_box_are_exact():
    q, r = _clouds("random", 30, 300)
    q = q * 5.0  # most queries fall outside the cloud's box, in its border cells
    d, _ = ops.launch_knn(q, r, 5, grid=True)
    want, _ = cKDTree(r.double().cpu().numpy()).query(q.double().cpu().numpy(), 5)
    torch.testing.assert_close(
        d.cpu(), torch.from_numpy(want).float(), atol=1e-4, rtol=1e-5
    )


def test_grid_sorts_points_by_cell_and_starts_every_cell():
    from extkernels.ops.triton import spatial

    q, r = _clouds("random", 20, 500)
    g = spatial.build(q, r, cells=6)
    keys = spatial.cell_keys(g.ref, g.lo, g.hi, 6)
    assert torch.equal(keys, keys.sort().values)  # sorted by cell
    assert torch.equal(g.ref, r[g.ref_index])
    counts = torch.bincount(keys.long(), minlength=6**3)
    assert torch.equal(g.start.diff().long(), counts)
    assert int(g.start[0]) == 0 and int(g.start[-1]) == 500


def test_plain_launch_is_exact_eager_and_compiled():
    q, r = _clouds("random", 45, 400, seed=3)
    want, _ = cKDTree(r.double().cpu().numpy()).query(q.double().cpu().numpy(), 6)
    want = torch.from_numpy(want).float()
    torch.testing.assert_close(ops.search(q, r, 6)[0].cpu(), want, atol=1e-4, rtol=0)
    if DEVICE != "cuda":
        return  # Dynamo recognises Triton kernels, not the interpreter running them
    compiled = torch.compile(lambda a, b: ops.search(a, b, 6), fullgraph=True)
    torch.testing.assert_close(compiled(q, r)[0].cpu(), want, atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the autotuner times configurations")
def test_autotuned_launch_is_exact_eager_and_compiled():
    q, r = _clouds("random", 300, 4000, seed=6)
    want = torch.cdist(q.double(), r.double()).topk(7, largest=False).values.float()
    got, _ = ops.search(q, r, 7, autotuned=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert kernels.knn_kernel_autotuned.best_config.kwargs["BLOCK_Q"] in (16, 32, 64)
    compiled = torch.compile(
        lambda a, b: ops.search(a, b, 7, autotuned=True), fullgraph=True
    )
    torch.testing.assert_close(compiled(q, r)[0], want, atol=1e-4, rtol=0)


def test_walk_stats_count_every_block_once():
    from extkernels.ops.triton import spatial

    q, r = _clouds("random", 200, 3000)
    kth = torch.cdist(q, r).topk(7, largest=False).values[:, -1]
    stats = spatial.walk_stats(q, r, kth, cells=10)
    parts = ["done in 27 cells", "done in 125 cells", "brute force"]
    assert sum(stats[p] for p in parts) == stats["blocks"] == 13
    assert stats["done in 27 cells"] > 0
    assert 0 < stats["share of the cloud examined"] < 0.5
    # Cells so small that no cube holds 7 points: every block falls to brute force.
    tiny = spatial.walk_stats(q, r, kth, cells=128)
    assert tiny["brute force"] == 13
    assert tiny["share of the cloud examined"] > 1


def test_cell_keys_in_pytorch_match_the_kernel():
    import os

    from extkernels.ops.triton import spatial

    q, r = _clouds("random", 10, 2000, seed=8)
    lo, hi = torch.aminmax(r, dim=0)
    kernel = spatial.cell_keys(r, lo, hi, 9)
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        in_torch = spatial.cell_keys(r.cpu(), lo.cpu(), hi.cpu(), 9)
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    assert (kernel.cpu() != in_torch).sum() <= 2  # a point on a cell's face may differ


def test_operator_opcheck_and_compile():
    q, r = _clouds("random", 40, 200)
    torch.library.opcheck(torch.ops.triton_knn.knn.default, (q, r, 5))
    compiled = torch.compile(
        lambda a, b: torch.ops.triton_knn.knn(a, b, 5), fullgraph=True
    )
    want = torch.cdist(q, r).topk(5, largest=False)
    torch.testing.assert_close(compiled(q, r)[0], want.values, atol=1e-5, rtol=1e-5)


def test_operator_rejects_k_larger_than_the_cloud():
    q, r = _clouds("random", 4, 6)
    with pytest.raises(ValueError, match="k: expected 1 <= k <= 6"):
        torch.ops.triton_knn.knn(q, r, 7)


@pytest.mark.parametrize(
    "m, n, f, k", [(40, 300, 25, 7), (17, 50, 5, 3), (8, 9, 40, 7)]
)
def test_fused_kernels_match_the_gather_and_its_gradient(m, n, f, k):
    from extkernels.ops.gather import softmax_gather

    q, r = _clouds("random", m, n)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(n, f, generator=g).to(DEVICE)
    out, w, idx = ops.launch_knn_aggregate(q, r, feats, k, 0.1, grid=False)
    d0, i0 = torch.cdist(q, r).topk(k, largest=False)
    leaf = feats.clone().requires_grad_(True)
    want = softmax_gather(d0, i0, leaf, 0.1)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    grad_out = torch.randn(m, f, generator=g).to(DEVICE)
    want.backward(grad_out)
    grad = torch.zeros(n, f, device=DEVICE)
    kernels.scatter_kernel[(triton.cdiv(m, 16),)](
        grad_out, w, idx, grad, m, f, K=k, BLOCK_Q=16, BLOCK_F=16
    )
    torch.testing.assert_close(grad, leaf.grad, atol=1e-5, rtol=1e-5)


def test_fused_operator_opcheck_gradcheck_and_compile():
    q, r = _clouds("random", 30, 120)
    feats = torch.randn(120, 6, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    args = (q, r, feats.requires_grad_(True), 5, 0.1)
    torch.library.opcheck(torch.ops.triton_knn.knn_aggregate_fwd.default, args)
    assert torch.autograd.gradcheck(
        lambda x: ops.knn_aggregate(q, r, x.float(), 5, 0.1).double(),
        (feats.detach().double().requires_grad_(True),),
        eps=1e-3,
        atol=1e-3,
        rtol=1e-3,
    )
    _compiled_gradient_matches_eager(q, r, feats.detach())


def test_fused_operator_compiles_for_dynamic_shapes():
    # On CPU tensors the operator traces the PyTorch brute force, whose compiled
    # search branches on a GPU only: cond failed here under dynamic shapes.
    q, r = _clouds("clustered", 30, 120, seed=1)
    feats = torch.randn(120, 6, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    _compiled_gradient_matches_eager(q, r, feats, dynamic=True)


def _compiled_gradient_matches_eager(q, r, feats, dynamic=False):
    compiled = torch.compile(
        lambda x: ops.knn_aggregate(q, r, x, 5, 0.1).square().sum(),
        fullgraph=True,
        dynamic=dynamic,
    )
    eager_leaf = feats.clone().requires_grad_(True)
    compiled_leaf = feats.clone().requires_grad_(True)
    ops.knn_aggregate(q, r, eager_leaf, 5, 0.1).square().sum().backward()
    compiled(compiled_leaf).backward()
    torch.testing.assert_close(
        compiled_leaf.grad, eager_leaf.grad, atol=1e-5, rtol=1e-5
    )


def test_flop_formula_is_visible_under_flop_counter_mode():
    from torch.utils.flop_counter import FlopCounterMode

    q, r = _clouds("random", 30, 120)
    feats = torch.randn(120, 6).to(DEVICE)
    with FlopCounterMode(display=False) as counter:
        ops.knn_aggregate(q, r, feats, 5, 0.1)
    counts = counter.get_flop_counts()["Global"]
    assert (
        counts[torch.ops.triton_knn.knn_aggregate_fwd] == 8 * 30 * 120 + 2 * 30 * 5 * 6
    )


@pytest.mark.parametrize("kind", ["random", "offset", "clustered"])
def test_grid_fused_launch_matches_the_gather(kind):
    from extkernels.ops.gather import softmax_gather

    m, n, f, k = 70, 700, 9, 7
    q, r = _clouds(kind, m, n, seed=4)
    feats = torch.randn(n, f, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out, weights, indices = ops.launch_knn_aggregate(q, r, feats, k, 0.1, grid=True)
    d0, i0 = torch.cdist(q.double(), r.double()).topk(k, largest=False)
    want = softmax_gather(d0.float(), i0, feats, 0.1)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # The same neighbour sets, in the callers' order of queries and points.
    assert torch.equal(indices.sort(dim=1).values, i0.sort(dim=1).values)
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(m, device=DEVICE))


def test_listings_show_the_function_inside_a_triton_kernel():
    from extkernels.notebook import decorated

    assert decorated(kernels.knn_kernel).__name__ == "knn_kernel"
    assert callable(decorated(kernels.knn_kernel))  # the function, not the kernel
    assert not hasattr(decorated(kernels.knn_kernel), "fn")


# ------------------------------------------------------- chapter 8's helpers


def test_generated_lines_are_read_from_inductors_code():
    from extkernels.experiments.triton_launch import generated_lines

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: (x.sin() * 2).sum(), fullgraph=True)
    x = torch.randn(64)
    result, lines = generated_lines(compiled, x, names=("fused",), call="(")
    torch.testing.assert_close(result, (x.sin() * 2).sum())
    assert lines and all("fused" in line and "(" in line for line in lines)
    assert all(line == line.strip() for line in lines)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="do_bench times on a CUDA GPU")
def test_autotune_times_name_the_chosen_configuration():
    from extkernels.experiments.triton_launch import autotune_times

    q, r = _clouds("random", 300, 4000, seed=6)
    ops.search(q, r, 7, autotuned=True)
    best = kernels.knn_kernel_autotuned.best_config
    times = autotune_times(q, r, 7, best, lambda a, b: ops.search(a, b, 7))
    assert times.index[0] == "fixed (BLOCK_Q=16, num_warps=1)"
    assert f"BLOCK_Q={best.kwargs['BLOCK_Q']}" in times.index[1]
    assert (times > 0).all()


def _runs(**rows):
    """A timing table: variant -> (forward min, median, max, train min, median, max)."""
    import pandas as pd

    cols = ["forward_min", "forward_ms", "forward_max"]
    cols += ["train_min", "train_ms", "train_max"]
    return pd.DataFrame({k: dict(zip(cols, v, strict=True)) for k, v in rows.items()}).T


def test_timing_quotes_read_the_graphed_variant_and_cuml():
    from extkernels.experiments.triton_launch import timing_quotes

    table = _runs(
        **{
            "knn/cuml-op+compile+rmm": (9.5, 10.0, 10.5, 11.5, 12.0, 13.0),
            "knn/triton+compile": (0.9, 1.0, 1.2, 2.9, 3.0, 3.4),
            "knn/triton+reduce-overhead": (0.89, 0.90, 0.91, 1.20, 1.30, 1.40),
        }
    )
    assert timing_quotes(table) == {
        "ro_fwd_max": 0.91,
        "fwd_gain_min": pytest.approx(9.5 / 0.91),
        "train_gain": pytest.approx(12.0 / 1.30),
    }
