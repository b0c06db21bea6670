"""The fused backend's own choices (chapter 11), beyond the conformance suite: every
number of threads per query finds chapter 9's neighbours, both radius kernels agree, and
a bad ``lanes`` is refused by the operator and by its fake, and the schemas' default
``lanes`` is the package's."""

import pytest
import torch
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
def test_the_schemas_default_lanes_is_the_packages(name):
    fused.prepare()
    schema = getattr(torch.ops.extkernels_fused, name).default._schema
    (lanes,) = [a for a in schema.arguments if a.name == "lanes"]
    assert lanes.default_value == fused.DEFAULT_LANES


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [1, 7, 16, 20])
def test_every_group_size_finds_chapter_9s_neighbours(k):
    fused.prepare()
    p_query, p_ref = _clouds("cuda")
    expected = torch.ops.extkernels_cpp.knn(p_query, p_ref, k)[0]
    for lanes in fused.LANES:
        got = torch.ops.extkernels_fused.knn(p_query, p_ref, k, lanes)[0]
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
