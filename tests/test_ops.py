"""The public operators against independent references (scipy's cKDTree and numpy)."""

import math
import re

import numpy as np
import pytest
import torch
from scipy.spatial import cKDTree

import extkernels
from extkernels.ops import registry, torch_backend

OPS = ["knn", "knn_aggregate", "radius_aggregate"]
SIGMA = 0.1
RADIUS = 0.3


# ---------------------------------------------------------------- independent references


def ref_knn(p_query, p_ref, k):
    """Distances and indices of the k nearest neighbours, from a k-d tree in float64."""
    tree = cKDTree(p_ref.double().numpy())
    d, i = tree.query(p_query.double().numpy(), k=k)
    m = p_query.shape[0]
    return d.reshape(m, k), i.reshape(m, k)


def ref_knn_aggregate(p_query, p_ref, feats, k, sigma):
    d, i = ref_knn(p_query, p_ref, k)
    logits = -d / sigma
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    f = feats.double().numpy()
    return np.einsum("mk,mkf->mf", w, f[i])


def ref_radius_aggregate(p_query, p_ref, feats, radius, sigma):
    q, r, f = p_query.double().numpy(), p_ref.double().numpy(), feats.double().numpy()
    out = np.zeros((q.shape[0], f.shape[1]))
    for row, neighbours in enumerate(cKDTree(r).query_ball_point(q, radius)):
        if not neighbours:
            continue
        d = np.linalg.norm(r[neighbours] - q[row], axis=1)
        w = np.exp(-d / sigma)
        out[row] = (w / w.sum()) @ f[neighbours]
    return out


def distances_of(p_query, p_ref, indices):
    """Float64 distances from each query to the reference rows named by ``indices``."""
    q, r = p_query.double(), p_ref.double()
    return (q[:, None, :] - r[indices]).norm(dim=-1)


def assert_close(actual, expected, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float64), expected, rtol=rtol, atol=atol)


# ---------------------------------------------------------------- knn


def test_knn_distances_match_kdtree(p_query, p_ref):
    d, _ = extkernels.knn(p_query, p_ref, 7)
    d_ref, _ = ref_knn(p_query, p_ref, 7)
    assert_close(d, d_ref)


def test_knn_indices_match_kdtree(p_query, p_ref):
    _, i = extkernels.knn(p_query, p_ref, 7)
    _, i_ref = ref_knn(p_query, p_ref, 7)
    np.testing.assert_array_equal(i.numpy(), i_ref)


def test_knn_distances_ascend_along_rows(p_query, p_ref):
    d, _ = extkernels.knn(p_query, p_ref, 7)
    assert bool((d[:, 1:] >= d[:, :-1]).all())


def test_knn_dtypes_and_shapes(p_query, p_ref):
    d, i = extkernels.knn(p_query, p_ref, 5)
    assert d.dtype == torch.float32
    assert i.dtype == torch.int64
    assert d.shape == i.shape == (p_query.shape[0], 5)


@pytest.mark.parametrize("chunk_size", [1, 7, 216, 10_000])
def test_knn_chunked_equals_unchunked(p_query, p_ref, chunk_size):
    d, i = extkernels.knn(p_query, p_ref, 7)
    d_c, i_c = extkernels.knn(p_query, p_ref, 7, chunk_size=chunk_size)
    torch.testing.assert_close(d_c, d, rtol=0, atol=0)
    assert torch.equal(i_c, i)


def test_knn_k_equal_one_finds_the_nearest_point(p_query, p_ref):
    d, i = extkernels.knn(p_query, p_ref, 1)
    d_ref, i_ref = ref_knn(p_query, p_ref, 1)
    assert d.shape == (p_query.shape[0], 1)
    assert_close(d, d_ref)
    np.testing.assert_array_equal(i.numpy(), i_ref)


def test_knn_k_equal_n_sorts_the_whole_cloud(p_query, p_ref):
    n = p_ref.shape[0]
    d, i = extkernels.knn(p_query, p_ref, n)
    d_ref, i_ref = ref_knn(p_query, p_ref, n)
    assert_close(d, d_ref)
    np.testing.assert_array_equal(i.numpy(), i_ref)
    assert all(sorted(row) == list(range(n)) for row in i.tolist())


def test_knn_duplicate_points_give_kdtree_distances(p_query, p_ref):
    doubled = torch.cat([p_ref, p_ref]).contiguous()
    d, i = extkernels.knn(p_query, doubled, 8)
    d_ref, _ = ref_knn(p_query, doubled, 8)
    assert_close(d, d_ref)
    # With ties the order of indices is ambiguous, but each must point at its distance.
    assert_close(distances_of(p_query, doubled, i), d_ref)


def test_knn_duplicate_points_come_in_equal_pairs(p_query, p_ref):
    doubled = torch.cat([p_ref, p_ref]).contiguous()
    d, _ = extkernels.knn(p_query, doubled, 8)
    torch.testing.assert_close(d[:, 0::2], d[:, 1::2])


def test_knn_single_reference_point(p_query):
    point = torch.tensor([[0.25, -0.5, 1.0]])
    d, i = extkernels.knn(p_query, point, 1)
    assert torch.equal(i, torch.zeros(p_query.shape[0], 1, dtype=torch.int64))
    expected = np.linalg.norm(p_query.double().numpy() - point.double().numpy(), axis=1)
    assert_close(d[:, 0], expected)


def test_knn_queries_far_outside_the_cloud(p_ref):
    far = torch.tensor([[100.0, 0.0, 0.0], [-50.0, 80.0, 30.0], [0.0, 0.0, -200.0]])
    d, i = extkernels.knn(far, p_ref, 5)
    d_ref, _ = ref_knn(far, p_ref, 5)
    # Far away, neighbour distances differ by less than float32 resolves: compare values only.
    assert_close(d, d_ref, rtol=1e-5, atol=1e-4)
    assert_close(distances_of(far, p_ref, i), d_ref, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- knn_aggregate


def test_knn_aggregate_matches_numpy(p_query, p_ref, feats):
    out = extkernels.knn_aggregate(p_query, p_ref, feats, 7, SIGMA)
    assert_close(out, ref_knn_aggregate(p_query, p_ref, feats, 7, SIGMA), rtol=1e-4, atol=1e-5)


def test_knn_aggregate_dtype_and_shape(p_query, p_ref, feats):
    out = extkernels.knn_aggregate(p_query, p_ref, feats, 7, SIGMA)
    assert out.dtype == torch.float32
    assert out.shape == (p_query.shape[0], feats.shape[1])


def test_knn_aggregate_with_k_one_copies_nearest_features(p_query, p_ref, feats):
    out = extkernels.knn_aggregate(p_query, p_ref, feats, 1, SIGMA)
    _, i_ref = ref_knn(p_query, p_ref, 1)
    torch.testing.assert_close(out, feats[torch.from_numpy(i_ref[:, 0])])


def test_knn_aggregate_chunked_equals_unchunked(p_query, p_ref, feats):
    full = extkernels.knn_aggregate(p_query, p_ref, feats, 7, SIGMA)
    chunked = extkernels.knn_aggregate(p_query, p_ref, feats, 7, SIGMA, chunk_size=7)
    torch.testing.assert_close(chunked, full)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_knn_aggregate_gradcheck_in_feats(chunk_size):
    p_ref = extkernels.reference_cloud(30, seed=1).double()
    p_query = extkernels.query_grid(2).double()
    feats = extkernels.features(30, 3, seed=1).double().requires_grad_()

    def fn(f):
        return torch_backend.knn_aggregate(p_query, p_ref, f, 4, 0.5, chunk_size=chunk_size)

    assert torch.autograd.gradcheck(fn, (feats,))


# ---------------------------------------------------------------- radius_aggregate


def test_radius_aggregate_matches_numpy(p_query, p_ref, feats):
    out = extkernels.radius_aggregate(p_query, p_ref, feats, RADIUS, SIGMA)
    expected = ref_radius_aggregate(p_query, p_ref, feats, RADIUS, SIGMA)
    assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_radius_aggregate_dtype_and_shape(p_query, p_ref, feats):
    out = extkernels.radius_aggregate(p_query, p_ref, feats, RADIUS, SIGMA)
    assert out.dtype == torch.float32
    assert out.shape == (p_query.shape[0], feats.shape[1])


def test_radius_aggregate_query_without_neighbours_gets_exact_zeros(p_query, p_ref, feats):
    far = torch.tensor([[10.0, 10.0, 10.0]])
    queries = torch.cat([p_query, far]).contiguous()
    assert not cKDTree(p_ref.numpy()).query_ball_point(far.numpy()[0], RADIUS)
    out = extkernels.radius_aggregate(queries, p_ref, feats, RADIUS, SIGMA)
    assert torch.equal(out[-1], torch.zeros(feats.shape[1]))
    assert_close(out, ref_radius_aggregate(queries, p_ref, feats, RADIUS, SIGMA), rtol=1e-4)


def test_radius_aggregate_weights_are_normalised(p_query, p_ref):
    ones = torch.ones(p_ref.shape[0], 1)
    out = extkernels.radius_aggregate(p_query, p_ref, ones, RADIUS, SIGMA)
    counts = np.array(
        [len(n) for n in cKDTree(p_ref.numpy()).query_ball_point(p_query.numpy(), RADIUS)]
    )
    assert (counts > 0).any() and (counts == 0).any()
    assert_close(out[:, 0], (counts > 0).astype(np.float64))


@pytest.mark.parametrize("chunk_size", [1, 7, 10_000])
def test_radius_aggregate_chunked_equals_unchunked(p_query, p_ref, feats, chunk_size):
    full = extkernels.radius_aggregate(p_query, p_ref, feats, RADIUS, SIGMA)
    chunked = extkernels.radius_aggregate(
        p_query, p_ref, feats, RADIUS, SIGMA, chunk_size=chunk_size
    )
    torch.testing.assert_close(chunked, full)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_radius_aggregate_gradcheck_in_feats(chunk_size):
    p_ref = extkernels.reference_cloud(30, seed=1).double()
    far = torch.tensor([[10.0, 10.0, 10.0]], dtype=torch.float64)
    p_query = torch.cat([extkernels.query_grid(2).double(), far]).contiguous()
    feats = extkernels.features(30, 3, seed=1).double().requires_grad_()

    def fn(f):
        return torch_backend.radius_aggregate(p_query, p_ref, f, 1.5, 0.5, chunk_size=chunk_size)

    assert torch.autograd.gradcheck(fn, (feats,))


# ---------------------------------------------------------------- bad inputs

N_SMALL = 20


def _valid():
    return {
        "p_query": extkernels.query_grid(2),
        "p_ref": extkernels.reference_cloud(N_SMALL),
        "feats": extkernels.features(N_SMALL, 2),
    }


def call(op, p_query, p_ref, feats, *, k=3, radius=0.5, sigma=0.1, **options):
    if op == "knn":
        return extkernels.knn(p_query, p_ref, k, **options)
    if op == "knn_aggregate":
        return extkernels.knn_aggregate(p_query, p_ref, feats, k, sigma, **options)
    return extkernels.radius_aggregate(p_query, p_ref, feats, radius, sigma, **options)


def _with_value(t, value):
    t = t.clone()
    t[1, 2] = value
    return t


def _non_contiguous(t):
    out = t.T.contiguous().T
    assert not out.is_contiguous() and out.shape == t.shape
    return out


BAD_CLOUDS = {
    "not a tensor": (lambda t: t.numpy(), TypeError),
    "float64": (lambda t: t.double(), TypeError),
    "int64": (lambda t: t.long(), TypeError),
    "shape (n, 2)": (lambda t: t[:, :2].contiguous(), ValueError),
    "1-D": (lambda t: t.reshape(-1), ValueError),
    "empty": (lambda t: t[:0], ValueError),
    "non-contiguous": (_non_contiguous, ValueError),
    "NaN": (lambda t: _with_value(t, math.nan), ValueError),
    "inf": (lambda t: _with_value(t, math.inf), ValueError),
    "-inf": (lambda t: _with_value(t, -math.inf), ValueError),
}


def names(message):
    """``match`` pattern: the message starts with the argument's name."""
    return "^" + re.escape(message) + ":"


@pytest.mark.parametrize("op", OPS)
def test_valid_inputs_are_accepted(op):
    out = call(op, **_valid())
    first = out[0] if op == "knn" else out
    assert first.shape[0] == _valid()["p_query"].shape[0]


@pytest.mark.parametrize("case", list(BAD_CLOUDS))
@pytest.mark.parametrize("arg", ["p_query", "p_ref"])
@pytest.mark.parametrize("op", OPS)
def test_bad_cloud_is_rejected(op, arg, case):
    make_bad, error = BAD_CLOUDS[case]
    inputs = _valid()
    inputs[arg] = make_bad(inputs[arg])
    with pytest.raises(error, match=names(arg)):
        call(op, **inputs)


@pytest.mark.parametrize(
    "k, error",
    [
        (0, ValueError),
        (-1, ValueError),
        (N_SMALL + 1, ValueError),
        (2.0, TypeError),
        (True, TypeError),
    ],
    ids=["zero", "negative", "more than N", "float", "bool"],
)
@pytest.mark.parametrize("op", ["knn", "knn_aggregate"])
def test_bad_k_is_rejected(op, k, error):
    with pytest.raises(error, match=names("k")):
        call(op, **_valid(), k=k)


@pytest.mark.parametrize(
    "radius", [0.0, -0.1, math.inf, math.nan], ids=["zero", "negative", "inf", "nan"]
)
def test_bad_radius_is_rejected(radius):
    with pytest.raises(ValueError, match=names("radius")):
        call("radius_aggregate", **_valid(), radius=radius)


@pytest.mark.parametrize(
    "sigma", [0.0, -1.0, math.inf, math.nan], ids=["zero", "negative", "inf", "nan"]
)
@pytest.mark.parametrize("op", ["knn_aggregate", "radius_aggregate"])
def test_bad_sigma_is_rejected(op, sigma):
    with pytest.raises(ValueError, match=names("sigma")):
        call(op, **_valid(), sigma=sigma)


@pytest.mark.parametrize("op", ["knn_aggregate", "radius_aggregate"])
def test_non_numeric_sigma_is_rejected(op):
    with pytest.raises(TypeError, match=names("sigma")):
        call(op, **_valid(), sigma="0.1")


BAD_FEATS = {
    "not a tensor": (lambda f: f.numpy(), TypeError),
    "wrong row count": (lambda f: f[:-1].contiguous(), ValueError),
    "1-D": (lambda f: f[:, 0].contiguous(), ValueError),
    "no columns": (lambda f: f[:, :0].contiguous(), ValueError),
    "float64": (lambda f: f.double(), TypeError),
    "non-contiguous": (_non_contiguous, ValueError),
}


@pytest.mark.parametrize("case", list(BAD_FEATS))
@pytest.mark.parametrize("op", ["knn_aggregate", "radius_aggregate"])
def test_bad_feats_are_rejected(op, case):
    make_bad, error = BAD_FEATS[case]
    inputs = _valid()
    inputs["feats"] = make_bad(inputs["feats"])
    with pytest.raises(error, match=names("feats")):
        call(op, **inputs)


@pytest.mark.parametrize("op", OPS)
def test_unknown_backend_is_rejected(op):
    with pytest.raises(ValueError, match=names("backend")):
        call(op, **_valid(), backend="no-such-backend")


@pytest.mark.parametrize("op", OPS)
def test_zero_chunk_size_is_rejected(op):
    with pytest.raises(ValueError, match=names("chunk_size")):
        call(op, **_valid(), chunk_size=0)


# ---------------------------------------------------------------- backends


@pytest.mark.parametrize("op", OPS)
def test_torch_backend_is_listed(op):
    assert "torch" in extkernels.backends(op)


def test_backends_of_unknown_op_raises():
    with pytest.raises(ValueError, match=names("op_name")):
        extkernels.backends("knn_aggregation")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA lists")
@pytest.mark.parametrize("op", OPS)
def test_registered_cuda_only_backends_are_not_listed_without_cuda(op):
    listed = set(extkernels.backends(op))
    cuda_only = {name for name, b in registry._REGISTRY[op].items() if "cpu" not in b.devices}
    assert not listed & cuda_only


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA lists")
def test_a_new_cuda_only_backend_is_not_listed_without_cuda(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "knn", dict(registry._REGISTRY["knn"]))
    registry.register("knn", "fake-cuda", devices=("cuda",))(torch_backend.knn)
    registry.register("knn", "fake-cpu", devices=("cpu",))(torch_backend.knn)
    listed = extkernels.backends("knn")
    assert "fake-cuda" not in listed
    assert "fake-cpu" in listed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA lists")
def test_cuda_only_backend_refuses_cpu_tensors(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "knn", dict(registry._REGISTRY["knn"]))
    registry.register("knn", "fake-cuda", devices=("cuda",))(torch_backend.knn)
    with pytest.raises(ValueError, match=names("backend")):
        call("knn", **_valid(), backend="fake-cuda")


def test_unavailable_backend_is_not_listed(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "knn", dict(registry._REGISTRY["knn"]))
    registry.register("knn", "not-installed", devices=("cpu",), available=lambda: False)(
        torch_backend.knn
    )
    assert "not-installed" not in extkernels.backends("knn")


def test_radius_aggregate_normalises_weights_when_all_neighbours_are_far_relative_to_sigma():
    p_ref = torch.tensor([[0.0, 0.0, 0.0], [0.05, 0.0, 0.0]])
    query = torch.tensor([[1.2, 0.0, 0.0]])  # both points within the radius, at d / sigma ~ 115-120
    feats = torch.tensor([[1.0], [2.0]])
    out = extkernels.radius_aggregate(query, p_ref, feats, 1.5, 0.01)
    expected = ref_radius_aggregate(query, p_ref, feats, 1.5, 0.01)
    assert_close(out, expected, rtol=1e-4)


def test_check_cloud_values_false_checks_metadata_only():
    from extkernels.ops.checks import check_cloud

    bad = torch.tensor([[0.0, float("nan"), 0.0]])
    with pytest.raises(ValueError, match="p_ref: expected finite"):
        check_cloud("p_ref", bad)
    assert check_cloud("p_ref", bad, values=False) is bad
    with pytest.raises(ValueError, match="p_ref: expected shape"):
        check_cloud("p_ref", bad[:, :2], values=False)
