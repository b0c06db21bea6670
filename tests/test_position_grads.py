"""Gradients with respect to the point positions, on every backend: exact (against the
torch reference, itself held to ``gradcheck`` in float64), or refused at forward time by
name; never ``None`` for a cloud that asked for one. Also the order of ties (the lowest
reference index first, on every backend the book writes) and the second order.

Part of the conformance suite: a backend joins by registering, and lists what it
differentiates in ``Backend.position_grads``.
"""

import functools

import numpy as np
import pytest
import torch
from conftest import DEVICES
from test_backends import (
    RADIUS,
    SIGMA,
    K,
    _cloud,
    _on,
    operator_cases,
    per_op,
    smooth_feats,
)

import extkernels
from extkernels.ops import registry
from extkernels.ops.torch import brute_force

OPS = ["knn", "knn_aggregate", "radius_aggregate"]
NAMED = "require(s)? grad; backend '.+' has no gradient of .+ with respect to positions"


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _self_queries(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The cloud's own points as queries, in random order: every query at distance 0
    from one reference point."""
    _, p_ref = _cloud("random", seed)
    order = torch.randperm(len(p_ref), generator=_generator(seed))[:150]
    return p_ref[order].contiguous(), p_ref


def _clouds(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "self queries":
        return _self_queries()
    if kind == "empty neighbourhoods":  # queries far from every point
        p_query, p_ref = _cloud("far queries")
        return p_query, p_ref
    return _cloud(kind)


def _call(op, backend, q, r, f):
    if op == "knn":
        return extkernels.knn(q, r, K, backend=backend)[0]
    if op == "knn_aggregate":
        return extkernels.knn_aggregate(q, r, f, K, SIGMA, backend=backend)
    return extkernels.radius_aggregate(q, r, f, RADIUS, SIGMA, backend=backend)


def _leaves(device, p_query, p_ref) -> list[torch.Tensor]:
    """Fresh leaves on ``device`` that require grad: the clouds and their features."""
    tensors = (p_query, p_ref, smooth_feats(p_ref))
    return [t.detach().to(device, copy=True).requires_grad_(True) for t in tensors]


def _grads(op, backend, device, p_query, p_ref, seed: int = 3):
    """The output and the gradients of ``<grad_out, op(...)>`` with respect to
    ``p_query``, ``p_ref`` and ``feats`` (on the CPU, in float32)."""
    q, r, f = _leaves(device, p_query, p_ref)
    out = _call(op, backend, q, r, f)
    grad_out = torch.randn(out.shape, generator=_generator(seed)).to(device)
    leaves = (q, r) if op == "knn" else (q, r, f)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return out.detach().cpu(), *(g.cpu() for g in grads)


# ---------------------------------------------------------------- the reference


def _reference_fn(op: str):
    def fn(q, r, f=None):
        if op == "knn":
            return brute_force.knn(q, r, K)[0]
        if op == "knn_aggregate":
            d, i = brute_force.knn(q, r, K)
            return extkernels.ops.gather.softmax_gather(d, i, f, SIGMA)
        return brute_force.radius_aggregate(q, r, f, RADIUS, SIGMA)

    return fn


def _inputs(op: str, q, r, f) -> tuple:
    """What ``op`` takes of the clouds and features: the kNN search takes no features,
    so ``gradcheck`` has nothing to perturb there."""
    return (q, r) if op == "knn" else (q, r, f)


def _float64(p_query, p_ref, scale: float = 1.0):
    feats = smooth_feats(p_ref).double()
    return [
        t.double().mul(s).requires_grad_(True)
        for t, s in ((p_query, scale), (p_ref, scale), (feats, 1.0))
    ]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("cloud", ["random", "flat", "far queries"])
def test_reference_passes_gradcheck(op, cloud):
    # (Not the clusters: points 1e-3 apart are reordered by gradcheck's own steps.)
    p_query, p_ref = _cloud(cloud)
    # the grid's first queries and the last ones (the far queries of "far queries"):
    # gradcheck's cost grows with outputs times inputs, so few queries against every
    # perturbed reference point (about half the queries have a neighbour in the radius)
    q, r, f = _float64(torch.cat([p_query[:20], p_query[-10:]]), p_ref[:200])
    assert torch.autograd.gradcheck(_reference_fn(op), _inputs(op, q, r, f))


@pytest.mark.parametrize("op", OPS)
def test_reference_passes_gradcheck_on_duplicates_for_queries_and_features(op):
    # Two copies of a point tie; moving a query moves both distances alike, so the
    # tie (taken by the lower index) holds under gradcheck's steps. Moving one copy
    # would break the tie: that derivative is one-sided, and not checked here.
    p_query, p_ref = _cloud("duplicates")
    half = len(p_ref) // 2  # the cloud is its first half twice: 100 points, twice
    q, r, f = _float64(p_query[:30], torch.cat([p_ref[:100], p_ref[half : half + 100]]))
    r.requires_grad_(False)
    assert torch.autograd.gradcheck(_reference_fn(op), _inputs(op, q, r, f))


def test_reference_gives_zeros_to_a_query_without_neighbour():
    p_query, p_ref = _cloud("far queries")
    q, r, f = _float64(p_query, p_ref)
    out = _reference_fn("radius_aggregate")(q, r, f)
    lonely = out.detach().abs().sum(dim=1) == 0
    assert lonely.sum() >= 30  # the far queries
    out.sum().backward()
    assert torch.equal(q.grad[lonely], torch.zeros_like(q.grad[lonely]))


@pytest.mark.parametrize("op", OPS)
def test_a_zero_distance_gives_a_finite_gradient_to_every_order(op):
    p_query, p_ref = _self_queries()
    q, r, f = _float64(p_query[:40], p_ref[:200])
    q = r.detach()[:40].clone().requires_grad_(True)  # exactly the points
    out = _reference_fn(op)(q, r, f)
    (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    assert torch.isfinite(gq).all()
    (ggq,) = torch.autograd.grad(gq.square().sum(), q)
    assert torch.isfinite(ggq).all()


@pytest.mark.parametrize("op", OPS)
def test_reference_second_order_passes_gradgradcheck(op):
    p_query, p_ref = _cloud("random")
    q, r, f = _float64(p_query[:15], p_ref[:120])
    assert torch.autograd.gradgradcheck(_reference_fn(op), _inputs(op, q, r, f))


# ------------------------------------------------------ every backend, every device

CLOUDS = ["random", "clusters", "self queries", "far queries", "offset 1000"]


def _tolerance(cloud: str) -> dict:
    # Position gradients scale as 1 / sigma (and as 1 / distance for knn): float32
    # rounding of distances near 1000 moves them by more than near the origin.
    return {"rtol": 1e-3, "atol": 1e-2 if cloud == "offset 1000" else 2e-3}


@pytest.mark.parametrize("cloud", CLOUDS)
@pytest.mark.parametrize("op, backend, device", per_op(OPS))
def test_position_gradients_match_the_reference_or_are_refused(
    op, backend, device, cloud
):
    p_query, p_ref = _clouds(cloud)
    if op not in registry.get(backend).position_grads:
        with pytest.raises(ValueError, match=NAMED):
            _grads(op, backend, device, p_query, p_ref)
        return
    expected = _grads(op, "torch", "cpu", p_query, p_ref)
    actual = _grads(op, backend, device, p_query, p_ref)
    names = ["output", "p_query", "p_ref", "feats"]
    for name, a, e in zip(names, actual, expected, strict=False):
        assert a is not None, f"{name}: no gradient"
        assert torch.isfinite(a).all(), f"{name}: not finite"
        torch.testing.assert_close(a, e, **_tolerance(cloud), msg=name)


@pytest.mark.parametrize("op, backend, device", per_op(OPS))
def test_no_position_that_requires_grad_gets_none(op, backend, device):
    # Only one of the clouds asks; the other does not, and gets nothing.
    p_query, p_ref = _cloud("random")
    feats = smooth_feats(p_ref).to(device)
    q = p_query.to(device, copy=True).requires_grad_(True)
    r = p_ref.to(device)
    try:
        out = _call(op, backend, q, r, feats)
    except ValueError as e:
        assert "p_query requires grad" in str(e)
        assert op not in registry.get(backend).position_grads
        return
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert grad is not None and grad.abs().sum() > 0


def _sum_grads(op, backend, device, p_query, p_ref):
    # The backward of a sum hands the operator an expanded (stride 0) gradient.
    leaves = _leaves(device, p_query, p_ref)
    if op not in registry.get(backend).position_grads:
        leaves[0].requires_grad_(False)
        leaves[1].requires_grad_(False)
    out = _call(op, backend, *leaves)
    wanted = [t for t in leaves[: 2 if op == "knn" else 3] if t.requires_grad]
    if not wanted:
        pytest.skip(f"{backend} differentiates nothing of {op}")
    return [g.cpu() for g in torch.autograd.grad(out.sum(), wanted)]


@pytest.mark.parametrize("op, backend, device", per_op(OPS))
def test_a_broadcast_output_gradient_gives_the_reference_gradients(op, backend, device):
    p_query, p_ref = _cloud("random")
    actual = _sum_grads(op, backend, device, p_query, p_ref)
    expected = _sum_grads(op, "torch", "cpu", p_query, p_ref)[-len(actual) :]
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, **_tolerance("random"))


@pytest.mark.parametrize("op, backend, device", per_op(OPS))
def test_the_refusal_names_the_argument_and_who_can(op, backend, device):
    if op in registry.get(backend).position_grads:
        pytest.skip(f"{backend} differentiates {op} with respect to positions")
    p_query, p_ref = _cloud("random")
    r = p_ref.to(device, copy=True).requires_grad_(True)
    with pytest.raises(ValueError) as e:
        _call(op, backend, p_query.to(device), r, smooth_feats(p_ref).to(device))
    message = str(e.value)
    assert message.startswith(f"p_ref requires grad; backend '{backend}'")
    assert "use backend 'torch'" in message or "'torch'" in message


@pytest.mark.parametrize("op, backend, device", per_op(OPS))
def test_under_no_grad_positions_are_not_refused(op, backend, device):
    q, r, f = _leaves(device, *_cloud("random"))
    with torch.no_grad():
        out = _call(op, backend, q, r, f)
    assert not out.requires_grad


def _with_positions(op: str, backend: str):
    def loss(q, r, f):
        out = _call(op, backend, q, r, f)
        return (out * torch.linspace(0.5, 1.5, out.shape[1], device=out.device)).sum()

    return loss


@pytest.mark.parametrize("op, backend, device", per_op(OPS))
def test_position_gradients_compile_with_fullgraph_and_match_eager(op, backend, device):
    if op not in registry.get(backend).position_grads:
        pytest.skip(f"{backend} refuses position gradients of {op}")
    torch._dynamo.reset()
    p_query, p_ref = _cloud("random")
    args = _leaves(device, p_query, p_ref)
    loss = _with_positions(op, backend)
    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):
        value = fn(*args)
        results.append((value.detach(), *torch.autograd.grad(value, args[:2])))
    for compiled, eager in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(
    "op, backend, device", per_op(["knn_aggregate", "radius_aggregate"])
)
def test_a_projector_whose_loss_depends_on_its_queries_compiles(op, backend, device):
    workload = "knn" if op == "knn_aggregate" else "radius"
    if op not in registry.get(backend).position_grads:
        pytest.skip(f"{backend} refuses position gradients of {op}")
    torch._dynamo.reset()
    torch.manual_seed(0)
    if workload == "knn":
        aggregation = extkernels.KnnAggregation(K, SIGMA, backend=backend)
    else:
        aggregation = extkernels.RadiusAggregation(RADIUS, SIGMA, backend=backend)
    model = extkernels.Projector(aggregation).to(device)
    p_query, p_ref = (t.to(device) for t in _cloud("random"))
    # A learned deformation of the queries: the loss depends on p_query through the
    # aggregation's weights, not only through a feature.
    shift = torch.zeros(3, device=device, requires_grad=True)

    def step(p_query, p_ref):
        return model(p_query + shift, p_ref).square().mean()

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        value = fn(p_query, p_ref)
        results.append((value.detach(), *torch.autograd.grad(value, [shift])))
    assert results[0][1].abs().sum() > 0
    for compiled, eager in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


def _operator_with_positions(op: str, device: str):
    q, r, f = _leaves(device, *_cloud("random"))
    if op == "knn":
        return (q, r, K)
    if op == "knn_aggregate":
        return (q, r, f, K, SIGMA)
    return (q, r, f, RADIUS, SIGMA)


def _operator_params(op: str) -> list:
    """The operators of ``op`` whose backend differentiates it in the clouds."""
    return [
        p for p in operator_cases(op) if op in registry.get(p.values[0]).position_grads
    ]


@pytest.mark.parametrize("op, backend, device", per_op(OPS, _operator_params))
def test_opcheck_with_positions_that_require_grad(op, backend, device):
    # opcheck compares the registered autograd with AOT dispatch, for every input that
    # requires grad: here the clouds too.
    operator = registry.get(backend).operator(op)
    torch.library.opcheck(operator, _operator_with_positions(op, device))


# ---------------------------------------------------------------- second order


#: The backends that differentiate every operation to the second order; the others may
#: refuse by name.
SECOND_ORDER = ("torch", "fused")


@pytest.mark.parametrize("op, backend, device", per_op(OPS))
def test_second_order_matches_the_reference_or_is_refused(op, backend, device):
    if op not in registry.get(backend).position_grads:
        pytest.skip(f"{backend} refuses position gradients of {op}")
    p_query, p_ref = _cloud("random")

    def second(backend, device):
        q, r, f = _leaves(device, p_query, p_ref)
        out = _call(op, backend, q, r, f)
        (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        return [g.cpu() for g in torch.autograd.grad(gq.square().sum(), (q, r))]

    expected = second("torch", "cpu")
    try:
        actual = second(backend, device)
    except RuntimeError as e:
        assert backend not in SECOND_ORDER, f"{backend} must give the second order: {e}"
        assert "no second-order gradient" in str(e), str(e)
        assert f"backend '{backend}'" in str(e)
        return
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-3, atol=1e-2)


# ---------------------------------------------------------------- ties


def lattice() -> tuple[torch.Tensor, torch.Tensor]:
    """Points on the integer lattice 0..5 (216 points in a shuffled order) and queries
    at cell centres, edge midpoints and lattice points: many neighbours at exactly equal
    distances, computed exactly in float32 by every formula."""
    side = torch.arange(6, dtype=torch.float32)
    points = torch.cartesian_prod(side, side, side)
    points = points[torch.randperm(len(points), generator=_generator(5))]
    centres = torch.cartesian_prod(*[torch.arange(5) + 0.5] * 3)[::7]
    edges = torch.cartesian_prod(torch.arange(5) + 0.5, side, side)[::9]
    queries = torch.cat([centres, edges, points[:20]])
    return queries.contiguous(), points.contiguous()


def lowest_index_first(p_query, p_ref, k) -> np.ndarray:
    q, r = p_query.double().numpy(), p_ref.double().numpy()
    d = np.linalg.norm(q[:, None] - r[None], axis=-1)
    columns = np.broadcast_to(np.arange(len(r)), d.shape)
    order = np.lexsort((columns, d), axis=1)  # by distance, then by index
    return order[:, :k]


TIE_BACKENDS = [p for p in per_op(["knn"]) if p.values[1] != "cuml"]


@pytest.mark.parametrize("k", [1, 7, 20])
@pytest.mark.parametrize("op, backend, device", TIE_BACKENDS)
def test_ties_go_to_the_lowest_reference_index(op, backend, device, k):
    p_query, p_ref = lattice()
    d, i = extkernels.knn(*_on(device, p_query, p_ref), k, backend=backend)
    np.testing.assert_array_equal(
        i.cpu().numpy(), lowest_index_first(p_query, p_ref, k)
    )


@pytest.mark.parametrize("op, backend, device", TIE_BACKENDS)
def test_every_index_option_breaks_ties_alike(op, backend, device):
    if backend != "fused":
        pytest.skip("the fused backend's indices and lanes")
    p_query, p_ref = lattice()
    q, r = _on(device, p_query, p_ref)
    expected = lowest_index_first(p_query, p_ref, K)
    for options in (
        {"index": "tree"},
        {"index": "grid", "lanes": 1},
        {"index": "grid"},
    ):
        _, i = extkernels.knn(q, r, K, backend=backend, **options)
        np.testing.assert_array_equal(i.cpu().numpy(), expected, err_msg=str(options))


def doubled_cloud() -> tuple[torch.Tensor, torch.Tensor]:
    """Random queries and every reference point twice (the copies apart in the index):
    each pair of copies ties."""
    g = _generator(6)
    points = torch.rand(300, 3, generator=g)
    return torch.rand(64, 3, generator=g), torch.cat([points, points])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    "cloud, k, chunk_size",
    [
        ("random", 7, None),  # no ties
        ("doubled", 8, None),  # ties inside the k kept, none at the k-th
        ("doubled", 7, None),  # the k-th and the (k+1)-th tie: the keys
        ("lattice", 7, None),
        ("mixed", 7, 10),  # slices of queries: the first ties at the k-th, no other
    ],
)
def test_the_torch_search_orders_ties_alike_whether_or_not_the_kth_ties(
    cloud, k, compiled, chunk_size, device
):
    if cloud == "lattice":
        p_query, p_ref = lattice()
    elif cloud == "mixed":  # ten cell centres of the lattice, then random queries
        p_query, p_ref = lattice()
        spread = 5 * torch.rand(30, 3, generator=_generator(7))
        p_query = torch.cat([p_query[:10], spread])
    elif cloud == "doubled":
        p_query, p_ref = doubled_cloud()
    else:
        p_query, p_ref = torch.rand(64, 3), torch.rand(300, 3)
    search = functools.partial(brute_force.knn, chunk_size=chunk_size)
    if compiled:
        torch.compiler.reset()
        search = torch.compile(search, fullgraph=True)
    d, i = search(*_on(device, p_query, p_ref), k)
    i = i.cpu()
    np.testing.assert_array_equal(i.numpy(), lowest_index_first(p_query, p_ref, k))
    torch.testing.assert_close(d.cpu(), (p_query[:, None] - p_ref[i]).norm(dim=-1))
