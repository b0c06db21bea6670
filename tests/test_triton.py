"""The Triton kNN kernel (chapter 8, in progress): exact against SciPy's k-d tree, run
by Triton's interpreter on CPU tensors where there is no GPU."""

import pytest
import torch

triton = pytest.importorskip("triton")
cKDTree = pytest.importorskip("scipy.spatial").cKDTree

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


@pytest.mark.parametrize(
    "kind, m, n, k",
    [
        ("random", 50, 300, 7),
        ("random", 37, 129, 3),
        ("random", 5, 7, 7),
        ("random", 64, 1000, 1),
        ("offset", 40, 200, 7),
        ("clustered", 40, 200, 7),
    ],
)
def test_kernel_is_exact(kind, m, n, k):
    q, r = _clouds(kind, m, n)
    d = torch.empty(m, k, device=DEVICE)
    i = torch.empty(m, k, dtype=torch.int64, device=DEVICE)
    unused = q.new_empty(1)
    kernels.knn_kernel[(triton.cdiv(m, 16),)](
        q, r, d, i, m, n, unused, unused, unused, unused,
        K=k, KP=kernels.next_power_of_2(k), BLOCK_Q=16, BLOCK_R=32,
    )  # fmt: skip
    want_d, _ = cKDTree(r.double().cpu().numpy()).query(q.double().cpu().numpy(), k)
    want_d = torch.from_numpy(want_d).float().reshape(m, k)
    torch.testing.assert_close(d.cpu(), want_d, atol=1e-4, rtol=1e-5)
    # Every index lies at its distance (ties may pick either point).
    at = (q[:, None, :] - r[i]).norm(dim=-1)
    torch.testing.assert_close(at, d, atol=1e-4, rtol=1e-5)


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
    out = torch.empty(m, f, device=DEVICE)
    w = torch.empty(m, k, device=DEVICE)
    idx = torch.empty(m, k, dtype=torch.int64, device=DEVICE)
    kp = kernels.next_power_of_2(k)
    grid = (triton.cdiv(m, 16),)
    unused = q.new_empty(1)
    kernels.knn_aggregate_kernel[grid](
        q, r, feats, out, w, idx, m, n, f, 10.0, unused, unused, unused, unused,
        K=k, KP=kp, BLOCK_Q=16, BLOCK_R=32, BLOCK_F=16,
    )  # fmt: skip
    d0, i0 = torch.cdist(q, r).topk(k, largest=False)
    leaf = feats.clone().requires_grad_(True)
    want = softmax_gather(d0, i0, leaf, 0.1)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    grad_out = torch.randn(m, f, generator=g).to(DEVICE)
    want.backward(grad_out)
    grad = torch.zeros(n, f, device=DEVICE)
    kernels.scatter_kernel[grid](
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
    compiled = torch.compile(
        lambda x: ops.knn_aggregate(q, r, x, 5, 0.1).square().sum(), fullgraph=True
    )
    eager_leaf = feats.detach().clone().requires_grad_(True)
    compiled_leaf = feats.detach().clone().requires_grad_(True)
    ops.knn_aggregate(q, r, eager_leaf, 5, 0.1).square().sum().backward()
    compiled(compiled_leaf).backward()
    torch.testing.assert_close(
        compiled_leaf.grad, eager_leaf.grad, atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("kind", ["random", "offset", "clustered"])
def test_pruned_kernel_is_exact_and_skips_tiles(kind):
    from extkernels.ops.triton import spatial

    m, n, k, bq, br = 64, 800, 7, 16, 16
    q, r = _clouds(kind, m, n, seed=3)
    p = spatial.plan(q, r, bq, br)
    d = torch.empty(m, k, device=DEVICE)
    i = torch.empty(m, k, dtype=torch.int64, device=DEVICE)
    visited = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    kernels.knn_kernel[(triton.cdiv(m, bq),)](
        p.query, p.ref, d, i, m, n, p.lo, p.hi, p.start, visited,
        K=k, KP=kernels.next_power_of_2(k), BLOCK_Q=bq, BLOCK_R=br, PRUNE=True,
    )  # fmt: skip
    dist, idx = torch.empty_like(d), torch.empty_like(i)
    dist[p.query_order], idx[p.query_order] = d, p.ref_order[i]
    want, _ = cKDTree(r.double().cpu().numpy()).query(q.double().cpu().numpy(), k)
    torch.testing.assert_close(
        dist.cpu(), torch.from_numpy(want).float(), atol=1e-4, rtol=1e-5
    )
    torch.testing.assert_close(
        (q[:, None] - r[idx]).norm(dim=-1), dist, atol=1e-4, rtol=1e-5
    )
    if kind != "clustered":  # four tight clusters: every tile may hold a neighbour
        assert int(visited) < triton.cdiv(m, bq) * triton.cdiv(n, br)


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
