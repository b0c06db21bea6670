"""What is specific to the ``torch`` backend (the conformance suite,
tests/test_backends.py, covers what every backend must do): slicing the queries, and
float64 gradient checks."""

import pytest
import torch

import extkernels
from extkernels.ops.torch import brute_force

SIGMA = 0.1
RADIUS = 0.3


@pytest.mark.parametrize("chunk_size", [1, 7, 216, 10_000])
def test_knn_chunked_equals_unchunked(p_query, p_ref, chunk_size):
    d, i = extkernels.knn(p_query, p_ref, 7)
    d_c, i_c = extkernels.knn(p_query, p_ref, 7, chunk_size=chunk_size)
    torch.testing.assert_close(d_c, d, rtol=0, atol=0)
    assert torch.equal(i_c, i)


def test_knn_aggregate_chunked_equals_unchunked(p_query, p_ref, feats):
    full = extkernels.knn_aggregate(p_query, p_ref, feats, 7, SIGMA)
    chunked = extkernels.knn_aggregate(p_query, p_ref, feats, 7, SIGMA, chunk_size=7)
    torch.testing.assert_close(chunked, full)


@pytest.mark.parametrize("chunk_size", [1, 7, 10_000])
def test_radius_aggregate_chunked_equals_unchunked(p_query, p_ref, feats, chunk_size):
    full = extkernels.radius_aggregate(p_query, p_ref, feats, RADIUS, SIGMA)
    chunked = extkernels.radius_aggregate(
        p_query, p_ref, feats, RADIUS, SIGMA, chunk_size=chunk_size
    )
    torch.testing.assert_close(chunked, full)


@pytest.mark.parametrize("op", ["knn", "knn_aggregate", "radius_aggregate"])
def test_zero_chunk_size_is_rejected(op, p_query, p_ref, feats):
    calls = {
        "knn": lambda: extkernels.knn(p_query, p_ref, 3, chunk_size=0),
        "knn_aggregate": lambda: extkernels.knn_aggregate(
            p_query, p_ref, feats, 3, SIGMA, chunk_size=0
        ),
        "radius_aggregate": lambda: extkernels.radius_aggregate(
            p_query, p_ref, feats, RADIUS, SIGMA, chunk_size=0
        ),
    }
    with pytest.raises(ValueError, match="^chunk_size:"):
        calls[op]()


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_knn_aggregate_gradcheck_in_feats(chunk_size):
    p_ref = extkernels.reference_cloud(30, seed=1).double()
    p_query = extkernels.query_grid(2).double()
    feats = extkernels.features(30, 3, seed=1).double().requires_grad_()
    aggregate = extkernels.ops.torch.BACKEND.knn_aggregate

    def fn(f):
        return aggregate(p_query, p_ref, f, 4, 0.5, chunk_size=chunk_size)

    assert torch.autograd.gradcheck(fn, (feats,))


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_radius_aggregate_gradcheck_in_feats(chunk_size):
    p_ref = extkernels.reference_cloud(30, seed=1).double()
    far = torch.tensor([[10.0, 10.0, 10.0]], dtype=torch.float64)
    p_query = torch.cat([extkernels.query_grid(2).double(), far]).contiguous()
    feats = extkernels.features(30, 3, seed=1).double().requires_grad_()

    def fn(f):
        return brute_force.radius_aggregate(
            p_query, p_ref, f, 1.5, 0.5, chunk_size=chunk_size
        )

    assert torch.autograd.gradcheck(fn, (feats,))


def test_radius_weights_do_not_underflow_when_neighbours_are_many_sigmas_away():
    # exp(-d / sigma) is 0 in float32 for d / sigma > ~103: the shift by the nearest
    # distance keeps the normalised weights exact.
    p_ref = torch.tensor([[0.0, 0.0, 0.0], [0.05, 0.0, 0.0]])
    query = torch.tensor([[1.2, 0.0, 0.0]])
    feats = torch.tensor([[1.0], [2.0]])
    out = extkernels.radius_aggregate(query, p_ref, feats, 1.5, 0.01)
    w_far = 1.0 / (
        1.0 + torch.exp(torch.tensor(5.0)).item()
    )  # exp(-(1.2 - 1.15) / 0.01)
    torch.testing.assert_close(out, torch.tensor([[1.0 * w_far + 2.0 * (1 - w_far)]]))


def test_turning_value_checks_off_does_not_recompile_a_compiled_projector():
    # A CUDA graph's capture runs with the value checks off: a compiled model that
    # guarded on the switch would recompile inside the capture, which fails.
    from extkernels.ops.checks import value_checks

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    model = extkernels.Projector(extkernels.KnnAggregation(3, 0.1, "torch"), 8)
    compiled = torch.compile(model, fullgraph=True)
    p_query, p_ref = extkernels.query_grid(3), extkernels.reference_cloud(50, seed=0)
    with torch.no_grad():
        compiled(p_query, p_ref)
        with value_checks(False):
            compiled(p_query, p_ref)
    assert counters["stats"]["unique_graphs"] == 1


RADIUS, SIGMA = 0.3, 0.1  # module globals: traced as symbolic floats with dynamic=True


def test_global_radius_and_sigma_compile_with_dynamic_shapes():
    def both(q, r, x):
        return (
            extkernels.radius_aggregate(q, r, x, RADIUS, SIGMA),
            extkernels.knn_aggregate(q, r, x, 4, SIGMA),
        )

    g = torch.Generator().manual_seed(0)
    q, r, x = (torch.randn(n, d, generator=g) for n, d in [(50, 3), (80, 3), (80, 4)])
    compiled = torch.compile(both, fullgraph=True, dynamic=True)
    for got, want in zip(compiled(q, r, x), both(q, r, x), strict=True):
        torch.testing.assert_close(got, want)
