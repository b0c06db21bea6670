"""Batches of clouds through every entry point (``query_offsets``, ``ref_offsets``), on
every registered backend: natively where its record lists the operation in ``batched``,
by a loop over the clouds elsewhere. Exact against SciPy per cloud with global indices,
equal to the unbatched operation cloud by cloud, the offsets' errors by name, the torch
backend compiled with ``fullgraph=True``, and the gradients with respect to positions.
"""

import numpy as np
import pytest
import torch
import torch._dynamo.testing
from scipy.spatial import cKDTree
from test_backends import _on, cases, per_op
from test_position_grads import NAMED, lowest_index_first

import extkernels
from extkernels.ops import registry
from extkernels.ops.batches import offsets_from_lengths
from extkernels.ops.gather import softmax_gather
from extkernels.ops.torch import brute_force

OPS = ["knn", "knn_aggregate", "radius_aggregate"]
SIGMA = 0.2
RADIUS = 0.6
N_FEATS = 4

#: Clouds of one batch, ``(kind, queries, reference points)``, overlapping in space so
#: that a query finding another cloud's point finds a nearer one. With k = 1: clouds of
#: one point; with k = 4: a cloud of exactly four. Both: a cloud without queries, a
#: single query, duplicate points (every pair a tie, taken by the lower index).
BATCHES = {
    1: [
        ("random", 30, 80),
        ("random", 1, 1),
        ("random", 0, 6),
        ("duplicates", 20, 40),
        ("random", 3, 1),
    ],
    4: [
        ("random", 30, 80),
        ("random", 0, 1),
        ("duplicates", 20, 40),
        ("random", 5, 4),
        ("random", 1, 9),
    ],
}


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def batch(spec, seed: int = 0):
    """``(p_query, p_ref, feats, query_offsets, ref_offsets)`` of the clouds of
    ``spec``."""
    g = _generator(seed)
    queries, refs = [], []
    for kind, m, n in spec:
        r = torch.rand(n, 3, generator=g)
        if kind == "duplicates":
            r = torch.cat([r[: n // 2], r[: n // 2]])
        queries.append(torch.rand(m, 3, generator=g))
        refs.append(r)
    p_query, p_ref = torch.cat(queries), torch.cat(refs)
    w = torch.randn(3, N_FEATS, generator=g)
    feats = torch.sin(p_ref @ w)  # a function of position: copies share features
    q_off = offsets_from_lengths(torch.tensor([m for _, m, _ in spec]))
    r_off = offsets_from_lengths(torch.tensor([n for *_, n in spec]))
    return p_query, p_ref, feats, q_off, r_off


def _call(op, q, r, f, qo, ro, backend, k=3, **kw):
    if op == "knn":
        return extkernels.knn(
            q, r, k, backend=backend, query_offsets=qo, ref_offsets=ro, **kw
        )
    if op == "knn_aggregate":
        return extkernels.knn_aggregate(
            q, r, f, k, SIGMA, backend=backend, query_offsets=qo, ref_offsets=ro, **kw
        )
    return extkernels.radius_aggregate(
        q, r, f, RADIUS, SIGMA, backend=backend, query_offsets=qo, ref_offsets=ro, **kw
    )


def _tensors(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _clouds(qo, ro):
    """``(b, query rows, reference rows)`` of every cloud with queries."""
    q, r = qo.tolist(), ro.tolist()
    return [
        (b, slice(q[b], q[b + 1]), slice(r[b], r[b + 1]))
        for b in range(len(q) - 1)
        if q[b + 1] > q[b]
    ]


# ---------------------------------------------------------------- the record


def test_the_torch_backend_takes_batches_natively_and_says_so():
    torch_backend = registry.get("torch")
    assert set(torch_backend.batched) == set(OPS)
    with pytest.raises(ValueError, match="batched: expected operations among"):
        registry.Backend("mine", knn=brute_force.knn, batched=("nearest",))
    # a derived knn_aggregate is batched where its search is
    mine = registry.Backend("mine", knn=brute_force.knn, batched=("knn",))
    assert mine.batched == ("knn", "knn_aggregate")


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("k", sorted(BATCHES))
@pytest.mark.parametrize("backend, device", cases("knn"))
def test_batched_knn_is_exact_per_cloud_with_global_indices(backend, device, k):
    p_query, p_ref, _, qo, ro = batch(BATCHES[k])
    d, i = extkernels.knn(
        *_on(device, p_query, p_ref),
        k,
        backend=backend,
        query_offsets=qo.to(device),
        ref_offsets=ro.to(device),
    )
    assert (d.shape, i.shape, i.dtype) == (
        (len(p_query), k),
        (len(p_query), k),
        torch.int64,
    )
    d, i = d.cpu().double().numpy(), i.cpu().numpy()
    for b, rows, cols in _clouds(qo, ro):
        q, r = p_query[rows].double().numpy(), p_ref[cols].double().numpy()
        ref_d, _ = cKDTree(r).query(q, k=k)
        ref_d = ref_d.reshape(len(q), k)
        np.testing.assert_allclose(d[rows], ref_d, atol=1e-6, err_msg=f"cloud {b}")
        assert ((i[rows] >= cols.start) & (i[rows] < cols.stop)).all(), (
            f"cloud {b}: a neighbour from another cloud"
        )
        if backend != "cuml":  # its order of ties is its own
            expected = lowest_index_first(p_query[rows], p_ref[cols], k) + cols.start
            np.testing.assert_array_equal(i[rows], expected, err_msg=f"cloud {b}")


@pytest.mark.parametrize("op, backend, device", per_op(OPS))
def test_one_cloud_is_the_unbatched_call(op, backend, device):
    p_query, p_ref, feats, _, _ = batch([("random", 30, 80)])
    args = _on(device, p_query, p_ref, feats)
    one = [torch.tensor([0, n], device=device) for n in (len(p_query), len(p_ref))]
    batched = _call(op, *args, *one, backend)
    alone = _call(op, *args, None, None, backend)
    # The fused backend takes a batch by another kernel than one cloud (every pair
    # tested, the softmax and the sums in PyTorch, against its tree search and fused
    # sums): the same neighbours in the same order, sums equal to rounding.
    tol = dict(rtol=1e-5, atol=1e-6) if backend == "fused" else dict(rtol=0, atol=0)
    for got, want in zip(_tensors(batched), _tensors(alone), strict=True):
        torch.testing.assert_close(got, want, **tol)  # indices: exact either way


@pytest.mark.parametrize(
    "op, backend, device", per_op(["knn_aggregate", "radius_aggregate"])
)
def test_batched_aggregation_is_the_unbatched_one_per_cloud(op, backend, device):
    spec = BATCHES[4] + [("random", 6, 0)]  # queries without reference points
    if op == "knn_aggregate":
        spec = BATCHES[4]
    p_query, p_ref, feats, qo, ro = batch(spec)
    q, r = _on(device, p_query, p_ref)
    f = feats.to(device).requires_grad_(True)
    grad_out = torch.randn(len(p_query), N_FEATS, generator=_generator(3)).to(device)
    out = _call(op, q, r, f, qo.to(device), ro.to(device), backend)
    (grad,) = torch.autograd.grad(out, f, grad_out)
    want_grad = torch.zeros_like(f)
    for b, rows, cols in _clouds(qo, ro):
        if cols.stop == cols.start:  # the unbatched result of a query without neighbour
            want = torch.zeros(rows.stop - rows.start, N_FEATS, device=device)
            torch.testing.assert_close(out[rows].detach(), want, rtol=0, atol=0)
            continue
        f_b = f.detach()[cols].clone().requires_grad_(True)
        alone = _call(op, q[rows], r[cols], f_b, None, None, backend)
        (g_b,) = torch.autograd.grad(alone, f_b, grad_out[rows])
        want_grad[cols] += g_b
        torch.testing.assert_close(out[rows].detach(), alone.detach(), msg=f"cloud {b}")
    torch.testing.assert_close(grad, want_grad)


def test_the_torch_slices_of_queries_may_straddle_clouds():
    p_query, p_ref, feats, qo, ro = batch(BATCHES[4])
    for op in OPS:
        whole = _call(op, p_query, p_ref, feats, qo, ro, "torch")
        sliced = _call(op, p_query, p_ref, feats, qo, ro, "torch", chunk_size=7)
        for a, b in zip(_tensors(whole), _tensors(sliced), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------- bad offsets


def _bad_offsets(op):
    """``(query_offsets, ref_offsets, k, match)`` for the batch of :func:`batch` of
    ``BATCHES[4]`` (ref offsets 0, 80, 81, 121, 125, 134; queries 0, 30, 30, 50, 55,
    56)."""
    qo, ro = batch(BATCHES[4])[3:]
    cases = [
        (qo.int(), ro, 3, "query_offsets: expected int64"),
        (qo, ro.float(), 3, "ref_offsets: expected int64"),
        (qo, ro.flip(0), 3, "ref_offsets: expected offsets starting at 0"),
        (qo, ro[[0, 2, 1, 3, 4, 5]], 3, "ref_offsets: expected non-decreasing"),
        (
            qo + torch.tensor([1, 0, 0, 0, 0, 0]),
            ro,
            3,
            "query_offsets: expected offsets starting at 0",
        ),
        (
            qo,
            torch.cat([ro[:-1], ro[-1:] - 1]),
            3,
            "ref_offsets: expected the last offset",
        ),
        (qo[:-1], ro, 3, "query_offsets: expected the last offset"),
        (
            qo[[0, 1, 3, 4, 5]],
            ro,
            3,
            "query_offsets, ref_offsets: expected as many clouds",
        ),
        (qo, None, 3, "ref_offsets: expected both"),
        (None, ro, 3, "query_offsets: expected both"),
    ]
    if op != "radius_aggregate":  # k > 0: every cloud with queries holds k points
        cases += [
            (qo, ro, 5, "ref_offsets: expected cloud 3 to hold at least k = 5"),
            (
                qo,
                torch.tensor([0, 80, 121, 121, 125, 134]),
                3,
                "ref_offsets: expected cloud 2 to hold at least k = 3 .* got 0",
            ),
        ]
    return cases


@pytest.mark.parametrize("op, backend, device", per_op(OPS))
def test_bad_offsets_are_refused_by_name(op, backend, device):
    p_query, p_ref, feats = _on(device, *batch(BATCHES[4])[:3])
    for qo, ro, k, match in _bad_offsets(op):
        qo, ro = (None if t is None else t.to(device) for t in (qo, ro))
        with pytest.raises((TypeError, ValueError), match=match):
            _call(op, p_query, p_ref, feats, qo, ro, backend, k=k)


@pytest.mark.parametrize("op, backend, device", per_op(OPS))
def test_offsets_on_another_device_are_refused_before_their_values_are_read(
    op, backend, device
):
    # Meta offsets hold no values to read: the device check comes first.
    p_query, p_ref, feats, qo, ro = _on(device, *batch(BATCHES[4])[:5])
    for name, offsets in (
        ("query_offsets", (qo.to("meta"), ro)),
        ("ref_offsets", (qo, ro.to("meta"))),
    ):
        with pytest.raises(ValueError, match=f"^{name}: expected a tensor on"):
            _call(op, p_query, p_ref, feats, *offsets, backend, k=3)


# ---------------------------------------------------------------- the compiler


TORCH = [p for p in cases("knn") if p.values[0] == "torch"]


def test_the_torch_batch_compiles_once_per_number_of_slices_or_once_for_all(
    monkeypatch,
):
    # Compiled, the slices are unrolled (the module's docstring): a graph per number of
    # slices by default, one graph for every size with a chunk_size of at least M.
    monkeypatch.setattr(brute_force, "BATCH_CHUNK", 1000)
    sizes = [(20, 30), (40, 30), (60, 30), (60, 45), (25, 45)]
    for chunk_size, graphs in ((None, 4), (10**6, 1)):
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounter()

        def search(q, r, qo, ro, chunk_size=chunk_size):
            return _call("knn", q, r, None, qo, ro, "torch", chunk_size=chunk_size)

        compiled = torch.compile(search, backend=counter, fullgraph=True, dynamic=True)
        for m, n in sizes:
            p_query, p_ref, _, qo, ro = batch([("random", m, n), ("random", m, n)])
            for got, want in zip(
                compiled(p_query, p_ref, qo, ro),
                search(p_query, p_ref, qo, ro),
                strict=True,
            ):
                torch.testing.assert_close(got, want)
        assert counter.frame_count == graphs


@pytest.mark.parametrize("backend, device", TORCH)
@pytest.mark.parametrize("op", OPS)
def test_the_torch_batch_compiles_with_fullgraph_and_matches_eager(op, backend, device):
    torch._dynamo.reset()
    p_query, p_ref, feats, qo, ro = _on(device, *batch(BATCHES[4]))
    feats.requires_grad_(True)

    def loss(q, r, f, qo, ro):
        out = _call(op, q, r, f, qo, ro, "torch")
        return out[0].sum() + out[1].sum() if op == "knn" else out.square().sum()

    explanation = torch._dynamo.explain(loss)(p_query, p_ref, feats, qo, ro)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)
    compiled = torch.compile(loss, fullgraph=True)
    # other offsets of the same shapes: their values are read by the graph, not traced
    other_q = torch.tensor([0, 10, 20, 50, 50, 56], device=device)
    other_r = torch.tensor([0, 40, 81, 100, 125, 134], device=device)
    for qo_, ro_ in ((qo, ro), (other_q, other_r)):
        results = []
        for fn in (loss, compiled):
            value = fn(p_query, p_ref, feats, qo_, ro_)
            grad = torch.autograd.grad(value, feats)[0] if op != "knn" else None
            results.append((value.detach(), grad))
        torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-4)
        if op != "knn":
            torch.testing.assert_close(
                results[1][1], results[0][1], rtol=1e-5, atol=1e-5
            )


LOOPED = [
    p for p in per_op(OPS) if p.values[0] not in registry.get(p.values[1]).batched
]


@pytest.mark.parametrize("op, backend, device", LOOPED)
def test_a_looped_batch_under_fullgraph_names_the_backend_and_the_native_one(
    op, backend, device
):
    torch._dynamo.reset()
    p_query, p_ref, feats, qo, ro = _on(device, *batch(BATCHES[4]))
    compiled = torch.compile(lambda *args: _call(op, *args, backend), fullgraph=True)
    with pytest.raises(
        Exception, match=f"backend: '{backend}' takes a batch .* 'torch'"
    ):
        compiled(p_query, p_ref, feats, qo, ro)


# ---------------------------------------------------------------- position gradients


def _reference(op, qo, ro, k=3):
    def fn(q, r, f):
        if op == "knn":
            return brute_force.knn(q, r, k, query_offsets=qo, ref_offsets=ro)[0]
        if op == "knn_aggregate":
            d, i = brute_force.knn(q, r, k, query_offsets=qo, ref_offsets=ro)
            return softmax_gather(d, i, f, SIGMA)
        return brute_force.radius_aggregate(
            q, r, f, RADIUS, SIGMA, query_offsets=qo, ref_offsets=ro
        )

    return fn


@pytest.mark.parametrize("op", OPS)
def test_the_torch_batch_passes_gradcheck(op):
    spec = [("random", 8, 12), ("random", 0, 3), ("random", 5, 4), ("random", 4, 6)]
    if op == "radius_aggregate":
        spec.append(("random", 3, 0))
    p_query, p_ref, feats, qo, ro = batch(spec, seed=1)
    args = [t.double().requires_grad_(True) for t in (p_query, p_ref, feats)]
    assert torch.autograd.gradcheck(_reference(op, qo, ro), args)


def _position_grads(op, backend, device, tensors, grad_out):
    p_query, p_ref, feats, qo, ro = _on(device, *tensors)
    leaves = [t.clone().requires_grad_(True) for t in (p_query, p_ref, feats)]
    out = _call(op, *leaves, qo, ro, backend)
    out = out[0] if op == "knn" else out
    grads = torch.autograd.grad(out, leaves[:2], grad_out.to(device))
    return [g.cpu() for g in grads]


@pytest.mark.parametrize("op, backend, device", per_op(OPS))
def test_position_gradients_of_a_batch_match_torch_or_are_refused(op, backend, device):
    spec = BATCHES[4] + ([("random", 6, 0)] if op == "radius_aggregate" else [])
    tensors = batch(spec, seed=2)
    width = 3 if op == "knn" else N_FEATS
    grad_out = torch.randn(len(tensors[0]), width, generator=_generator(4))
    expected = _position_grads(op, "torch", "cpu", tensors, grad_out)
    if op not in registry.get(backend).position_grads:
        with pytest.raises(ValueError, match=NAMED):
            _position_grads(op, backend, device, tensors, grad_out)
        return
    actual = _position_grads(op, backend, device, tensors, grad_out)
    if backend == "cuml":
        # cuML orders equal distances its own way: of two copies of a point, either
        # may be the neighbour, so only the copies' summed gradient is defined
        actual[1], expected[1] = (
            _per_position(tensors[1], g) for g in (actual[1], expected[1])
        )
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-3, atol=1e-2)


def _per_position(points, grads):
    """``grads`` of the rows of ``points`` summed over rows at the same position."""
    _, group = torch.unique(points, dim=0, return_inverse=True)
    return torch.zeros(int(group.max()) + 1, 3, dtype=grads.dtype).index_add_(
        0, group, grads
    )
