"""The fused backend's batched brute-force kNN (chapter 11): exact against SciPy's
k-d tree cloud by cloud, with global rows and ties to the lower row, the same as the
single-cloud search for one cloud, its errors naming the argument, its fake, its
compiled form and its gradients in both clouds; and its CUDA source, with chapter 9's
and chapter 16's radius search, compiled by ``nvcc`` where it is installed (the kernel
itself runs in the `gpu` variants)."""

import shutil

import numpy as np
import pytest
import torch
from conftest import DEVICES, nvcc_compiles
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

cKDTree = pytest.importorskip("scipy.spatial").cKDTree

from extkernels.ops import fused  # noqa: E402
from extkernels.ops.cpp import build as cpp_build  # noqa: E402
from extkernels.ops.fused import build  # noqa: E402
from extkernels.ops.torch import brute_force  # noqa: E402

pytestmark = pytest.mark.skipif(not fused.available(), reason="needs a C++ compiler")


def OP(*args):
    return torch.ops.extkernels_fused.knn_batched(*args)


def _batch(query_sizes, ref_sizes, device="cpu", seed=0):
    """Random clouds packed as in extkernels.ops.batches, each cloud shifted away from
    the others (a search that crossed clouds would find nearer points)."""
    g = torch.Generator().manual_seed(seed)
    qs, rs = [], []
    for b, (m, n) in enumerate(zip(query_sizes, ref_sizes, strict=True)):
        qs.append(torch.rand(m, 3, generator=g) + 0.3 * b)
        rs.append(torch.rand(n, 3, generator=g) + 0.3 * b)
    offsets = [
        torch.tensor([0, *np.cumsum(s)], dtype=torch.int64)
        for s in (query_sizes, ref_sizes)
    ]
    return [t.to(device) for t in (torch.cat(qs), torch.cat(rs), *offsets)]


def _scipy(p_query, p_ref, query_offsets, ref_offsets, k):
    """Distances and global rows, cloud by cloud, in float64."""
    q, r = p_query.cpu().double().numpy(), p_ref.cpu().double().numpy()
    qo, ro = query_offsets.tolist(), ref_offsets.tolist()
    d, i = np.zeros((len(q), k)), np.zeros((len(q), k), dtype=np.int64)
    for b in range(len(qo) - 1):
        if qo[b + 1] == qo[b]:
            continue
        dd, ii = cKDTree(r[ro[b] : ro[b + 1]]).query(q[qo[b] : qo[b + 1]], k)
        d[qo[b] : qo[b + 1]] = np.reshape(dd, (-1, k))
        i[qo[b] : qo[b + 1]] = np.reshape(ii, (-1, k)) + ro[b]
    return torch.from_numpy(d), torch.from_numpy(i)


@pytest.fixture(scope="module", autouse=True)
def _loaded():
    fused.prepare()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "query_sizes, ref_sizes, k",
    [
        ([300, 0, 150, 200], [400, 3, 256, 90], 16),  # a cloud without queries
        ([500], [700], 33),  # one cloud, k past a warp
        ([64] * 12, [100] * 12, 1),
        ([40, 300], [64, 64], 64),  # k = the whole cloud, the kernels' most
        # groups of 8, 16 and 32 lanes per query on the GPU, clouds ending inside a
        # warp, clouds of exactly k points, sizes that are not multiples of a group
        ([13, 7, 29, 3], [10, 9, 40, 8], 8),
        ([15, 1, 33], [17, 16, 40], 16),
        ([37, 5, 91], [50, 20, 130], 20),
        ([200], [1000], 32),
        # past 8,192 points per cloud on average the GPU takes a thread per query
        ([300, 200], [9000, 8000], 16),
        ([700], [8193], 32),
    ],
)
def test_exact_against_scipy_cloud_by_cloud(device, query_sizes, ref_sizes, k):
    args = _batch(query_sizes, ref_sizes, device)
    d, i = fused.knn_batched(*args, k)
    assert d.dtype == torch.float32 and i.dtype == torch.int64
    want_d, want_i = _scipy(*args, k)
    assert torch.equal(i.cpu(), want_i)
    torch.testing.assert_close(d.cpu().double(), want_d, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_clouds_of_one_point_with_k_1(device):
    p_query, p_ref, qo, ro = _batch([3, 1, 2], [1, 1, 1], device)
    d, i = fused.knn_batched(p_query, p_ref, qo, ro, 1)
    assert i.squeeze(1).tolist() == [0, 0, 0, 1, 2, 2]
    want = (p_query - p_ref[i.squeeze(1)]).norm(dim=1)
    torch.testing.assert_close(d.squeeze(1), want)


@pytest.mark.parametrize("device", DEVICES)
def test_duplicates_are_ranked_by_the_lower_row(device):
    p_query, p_ref, qo, ro = _batch([50, 60], [30, 40], device)
    # every reference point three times over, the copies 30 (40) rows apart
    clouds = [p_ref[:30], p_ref[30:]]
    p_ref = torch.cat([c.repeat(3, 1) for c in clouds])
    ro = torch.tensor([0, 90, 210], device=device)
    d, i = fused.knn_batched(p_query, p_ref, qo, ro, 9)
    want_d, want_i = _scipy(p_query[:50], clouds[0], qo[:2], ro.new_tensor([0, 30]), 3)
    first = i[:50].cpu()
    assert torch.equal(first[:, 0::3], want_i)  # the nearest point's first copy
    assert torch.equal(first[:, 1::3], want_i + 30)  # then its second, its third
    assert torch.equal(first[:, 2::3], want_i + 60)
    assert torch.equal(d[:, 0::3], d[:, 1::3]) and torch.equal(d[:, 0::3], d[:, 2::3])
    assert bool((i[50:] >= 90).all())


@pytest.mark.parametrize("device", DEVICES)
def test_one_cloud_is_the_single_cloud_search(device):
    p_query, p_ref, qo, ro = _batch([400], [900], device)
    d, i = fused.knn_batched(p_query, p_ref, qo, ro, 12)
    want_d, want_i = torch.ops.extkernels_fused.knn(p_query, p_ref, 12)
    assert torch.equal(i, want_i)
    torch.testing.assert_close(d, want_d)  # the tree rounds some last bits otherwise


def _bad(change):
    args = list(_batch([20, 30], [25, 40]))
    return change(args)


BAD = {
    "p_query dtype": (
        lambda a: [a[0].double(), *a[1:]],
        TypeError,
        "p_query: expected dtype torch.float32",
    ),
    "p_ref shape": (
        lambda a: [a[0], a[1][:, :2].contiguous(), *a[2:]],
        ValueError,
        r"p_ref: expected shape \(n, 3\)",
    ),
    "offsets dtype": (
        lambda a: [*a[:2], a[2].int(), a[3]],
        TypeError,
        "query_offsets: expected int64 offsets",
    ),
    "offsets shape": (
        lambda a: [*a[:3], a[3].reshape(1, -1)],
        ValueError,
        r"ref_offsets: expected shape \(B \+ 1,\)",
    ),
    "clouds": (
        lambda a: [*a[:3], torch.tensor([0, 10, 25, 65])],
        ValueError,
        "query_offsets, ref_offsets: expected as many clouds",
    ),
    "last offset": (
        lambda a: [*a[:3], torch.tensor([0, 25, 41])],
        ValueError,
        "ref_offsets: expected the last offset to be the number of points, 65",
    ),
    "first offset": (
        lambda a: [*a[:2], torch.tensor([1, 20, 50]), a[3]],
        ValueError,
        "query_offsets: expected offsets starting at 0",
    ),
    "decreasing": (
        lambda a: [*a[:2], torch.tensor([0, 30, 20]), a[3]],
        ValueError,
        "query_offsets: expected non-decreasing offsets",
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_refused_by_the_entry_and_the_operator(name):
    change, error, message = BAD[name]
    args = _bad(change)
    with pytest.raises(error, match=message):
        fused.knn_batched(*args, 5)
    with pytest.raises(error, match=message):
        OP(*args, 5)


@pytest.mark.parametrize("k", [0, 65])
def test_a_k_out_of_range_is_refused_by_the_entry_the_operator_and_the_fake(k):
    args = _bad(lambda a: a)
    message = r"k: expected 1 <= k <= 64"
    with pytest.raises(ValueError, match=message):
        fused.knn_batched(*args, k)
    with pytest.raises(ValueError, match=message):
        OP(*args, k)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match=message):
        OP(*(mode.from_tensor(a) for a in args), k)


def test_a_short_cloud_is_named_and_a_cloud_without_queries_may_be_short():
    args = _batch([20, 0, 30], [25, 2, 3])
    with pytest.raises(ValueError, match="ref_offsets: expected cloud 2 to hold at"):
        fused.knn_batched(*args, 4)
    with pytest.raises(ValueError, match="ref_offsets: expected cloud 2 to hold at"):
        OP(*args, 4)
    fused.knn_batched(*args, 3)  # cloud 1 holds 2 points but has no query


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    p_query, p_ref, qo, ro = _batch([30, 0, 45], [40, 5, 60], device)
    opcheck(torch.ops.extkernels_fused.knn_batched.default, (p_query, p_ref, qo, ro, 7))
    q, r = (t.clone().requires_grad_(True) for t in (p_query, p_ref))
    opcheck(torch.ops.extkernels_fused.knn_batched.default, (q, r, qo, ro, 7))


@pytest.mark.parametrize("device", DEVICES)
def test_compiles_with_fullgraph_and_matches_eager(device):
    torch._dynamo.reset()
    args = _batch([100, 80], [120, 70], device)

    def search(p_query, p_ref, qo, ro):
        d, i = fused.knn_batched(p_query, p_ref, qo, ro, 8)
        return d.sum(dim=1), i

    eager = search(*args)
    compiled = torch.compile(search, fullgraph=True)(*args)
    torch.testing.assert_close(compiled[0], eager[0])
    assert torch.equal(compiled[1], eager[1])


def _reference(p_query, p_ref, qo, ro, k):
    """The torch brute force, cloud by cloud, differentiable in both clouds."""
    qo, ro = qo.tolist(), ro.tolist()
    return torch.cat(
        [
            brute_force.knn(p_query[qo[b] : qo[b + 1]], p_ref[ro[b] : ro[b + 1]], k)[0]
            for b in range(len(qo) - 1)
        ]
    )


@pytest.mark.parametrize("device", DEVICES)
def test_position_gradients_match_the_reference(device):
    # As the suite does for every float32 operator (test_position_grads.py): against
    # the torch reference, itself held to gradcheck in float64 (below).
    p_query, p_ref, qo, ro = _batch([60, 90], [80, 50], device)
    grad_out = torch.randn(150, 6, generator=torch.Generator().manual_seed(1))
    grads = []
    for fn in (fused.knn_batched, _reference):
        q, r = (
            t.detach().cpu().to(device).requires_grad_(True) for t in (p_query, p_ref)
        )
        d = fn(q, r, qo, ro, 6)
        d = d[0] if isinstance(d, tuple) else d
        grads.append(
            [g.cpu() for g in torch.autograd.grad(d, (q, r), grad_out.to(device))]
        )
    for got, want in zip(*grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-3, atol=2e-3)


def test_the_reference_passes_gradcheck_in_float64():
    p_query, p_ref, qo, ro = _batch([12, 9], [15, 10])
    q, r = (t.double().requires_grad_(True) for t in (p_query, p_ref))
    assert torch.autograd.gradcheck(lambda q, r: _reference(q, r, qo, ro, 4), (q, r))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_cuda_sources_compile(tmp_path):
    # Chapter 9's kNN kernel, the batched kNN's and chapter 16's radius search, as one
    # translation unit: PyTorch's headers, most of the time, are read once.
    sources = [
        cpp_build.CSRC / "knn_cuda.cu",
        build.CSRC / "knn_batched_cuda.cu",
        build.CSRC / "radius_search_cuda.cu",
    ]
    unit = tmp_path / "unit.cu"
    unit.write_text("".join(f'#include "{s}"\n' for s in sources))
    folders = [cpp_build.CSRC, build.CSRC]
    nvcc_compiles(unit, folders, build.defines(), tmp_path)
