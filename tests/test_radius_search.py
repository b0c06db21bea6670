"""The radius search (``extkernels.radius_search``) and the kNN graph
(``extkernels.knn_graph``): exact against SciPy's k-d tree, sorted, batched, padded,
differentiable in both clouds, and whole under ``opcheck``, ``torch.compile`` and
``torch.export`` although its output size depends on the data.

Gradients are checked in float64, which the torch backend's operators take as they take
float32. ``opcheck`` runs all four of its default tests on both operators: the fake's
unbacked size ``E`` passes ``test_aot_dispatch_dynamic`` in torch 2.13, as long as the
operator's first output is a float (the test sums every output into the first one's
dtype), which is why the operators return their distances first.
"""

import functools
import math

import numpy as np
import pytest
import torch
from scipy.spatial import cKDTree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import ProfilerActivity

import extkernels as ek
from extkernels import profiling
from extkernels.ops import registry
from extkernels.ops.checks import value_checks
from extkernels.ops.torch.radius_search import radius_search_csr, radius_search_padded

RADIUS = 0.5
#: Pairs this close to the radius may fall either side of it in float32.
BAND = 1e-5

#: Every backend with a radius search: each passes the tests of exactness, order,
#: batches, gradients and the compiler below.
BACKENDS = ek.backends("radius_search")

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"),
        ],
    ),
]


def _clouds(kind: str, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    p_ref = torch.randn(300, 3, generator=g)
    p_query = torch.randn(70, 3, generator=g)
    if kind == "duplicates":  # every reference point three times
        p_ref = p_ref[:100].repeat(3, 1)
    elif kind == "self":  # the queries are the reference points
        p_query = p_ref.clone()
    elif kind == "far":  # one query with no neighbour
        p_query[3] = torch.tensor([50.0, 50.0, 50.0])
    elif kind == "one point":
        p_ref = p_ref[:1]
    elif kind != "random":
        raise ValueError(kind)
    return p_query.contiguous().to(device), p_ref.contiguous().to(device)


def _rows(offsets, indices, distances):
    offsets = offsets.tolist()
    return [
        (indices[a:b].tolist(), distances[a:b].tolist())
        for a, b in zip(offsets[:-1], offsets[1:], strict=True)
    ]


def _assert_matches_scipy(p_query, p_ref, rows, radius=RADIUS, shift=0):
    """Each query's neighbours are SciPy's (pairs within :data:`BAND` of the radius
    excepted), their distances the float64 ones, ``shift`` added to SciPy's indices."""
    q, r = p_query.double().cpu().numpy(), p_ref.double().cpu().numpy()
    want = cKDTree(r).query_ball_point(q, radius) if len(r) else [[] for _ in q]
    assert len(rows) == len(q)
    for i, ((got, dist), expected) in enumerate(zip(rows, want, strict=True)):
        got_set, want_set = set(got), {j + shift for j in expected}
        assert len(got_set) == len(got), f"query {i}: an index twice"
        for j in got_set ^ want_set:
            exact = np.linalg.norm(q[i] - r[j - shift])
            assert abs(exact - radius) < BAND, f"query {i}: {j} at {exact}"
        exact = np.linalg.norm(q[i] - r[np.array(got, dtype=int) - shift], axis=1)
        np.testing.assert_allclose(dist, exact, rtol=1e-5, atol=1e-5)


def _assert_sorted(rows):
    for got, dist in rows:
        keys = list(zip(dist, got, strict=True))
        assert keys == sorted(keys), "not by distance, then by index"


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["random", "duplicates", "self", "far", "one point"])
def test_matches_scipy_and_is_sorted(kind, device, backend):
    search = functools.partial(ek.radius_search, backend=backend)
    p_query, p_ref = _clouds(kind, device)
    offsets, indices, distances = search(p_query, p_ref, RADIUS)
    assert offsets.dtype == indices.dtype == torch.int64
    assert distances.dtype == torch.float32
    assert offsets.shape == (p_query.shape[0] + 1,) and offsets[0] == 0
    rows = _rows(offsets, indices, distances)
    _assert_matches_scipy(p_query, p_ref, rows)
    _assert_sorted(rows)
    assert sum(len(g) for g, _ in rows) > (0 if kind != "one point" else -1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_query_with_no_neighbour_has_an_empty_row(backend):
    search = functools.partial(ek.radius_search, backend=backend)
    p_query, p_ref = _clouds("far")
    offsets, _, _ = search(p_query, p_ref, RADIUS)
    assert offsets[3] == offsets[4]
    indices, distances, counts = search(p_query, p_ref, RADIUS, max_neighbours=4)
    assert counts[3] == 0
    assert (indices[3] == -1).all() and torch.isinf(distances[3]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_radius_is_inclusive(backend):
    search = functools.partial(ek.radius_search, backend=backend)
    p_ref = torch.tensor([[0.0, 0.0, 0.0], [0.75, 0.0, 0.0], [0.0, 0.5, 0.0]])
    p_query = torch.tensor([[0.0, 0.0, 0.0]])
    offsets, indices, distances = search(p_query, p_ref, 0.5)
    assert indices.tolist() == [0, 2] and distances.tolist() == [0.0, 0.5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicates_tie_by_the_lower_index_in_both_forms(backend):
    search = functools.partial(ek.radius_search, backend=backend)
    p_ref = torch.tensor([[1.0, 0, 0], [0.2, 0, 0], [1.0, 0, 0], [0.2, 0, 0]])
    p_query = torch.zeros(1, 3)
    _, indices, _ = search(p_query, p_ref, 2.0)
    assert indices.tolist() == [1, 3, 0, 2]
    padded, _, counts = search(p_query, p_ref, 2.0, max_neighbours=3)
    assert padded.tolist() == [[1, 3, 0]] and counts.tolist() == [3]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
def test_an_empty_reference_cloud_gives_no_neighbours(device, backend):
    search = functools.partial(ek.radius_search, backend=backend)
    p_query, _ = _clouds("random", device)
    empty = p_query.new_empty(0, 3)
    offsets, indices, distances = search(p_query, empty, RADIUS)
    assert offsets.tolist() == [0] * (p_query.shape[0] + 1)
    assert indices.shape == distances.shape == (0,)
    indices, distances, counts = search(p_query, empty, RADIUS, max_neighbours=2)
    assert (indices == -1).all() and torch.isinf(distances).all()
    assert (counts == 0).all() and indices.shape == (p_query.shape[0], 2)
    offsets, indices, _ = search(empty, p_query, RADIUS)
    assert offsets.tolist() == [0] and indices.shape == (0,)


def test_chunks_change_nothing():
    p_query, p_ref = _clouds("duplicates")
    whole = ek.radius_search(p_query, p_ref, RADIUS, chunk_size=10**6)
    for chunk in (1, 7, 64):
        chunked = ek.radius_search(p_query, p_ref, RADIUS, chunk_size=chunk)
        for got, want in zip(chunked, whole, strict=True):
            assert torch.equal(got, want)
        padded = ek.radius_search(p_query, p_ref, RADIUS, max_neighbours=5)
        chunked = ek.radius_search(
            p_query, p_ref, RADIUS, max_neighbours=5, chunk_size=chunk
        )
        for got, want in zip(chunked, padded, strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("search", ["knn", "radius_search"])
def test_the_torch_searches_name_a_bad_chunk_size(search):
    p_query, p_ref = _clouds("random")
    call = functools.partial(
        getattr(ek, search), p_query, p_ref, 3 if search == "knn" else RADIUS
    )
    with pytest.raises(ValueError, match="^chunk_size: expected a positive number"):
        call(chunk_size=0)
    # The radius search's operator schema refuses a float by the argument's name too.
    error = TypeError if search == "knn" else RuntimeError
    with pytest.raises(error, match="int.*chunk_size|chunk_size.*int"):
        call(chunk_size=2.5)


# ----------------------------------------------------------- padded and batched


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 3, 40])
def test_padded_form_is_the_first_k_of_each_row(k, device, backend):
    search = functools.partial(ek.radius_search, backend=backend)
    p_query, p_ref = _clouds("duplicates", device)
    offsets, indices, distances = search(p_query, p_ref, RADIUS)
    top, near, counts = search(p_query, p_ref, RADIUS, max_neighbours=k)
    assert top.shape == near.shape == (p_query.shape[0], k)
    assert near.dtype == torch.float32 and top.dtype == counts.dtype == torch.int64
    for i, (got, dist) in enumerate(_rows(offsets, indices, distances)):
        n = min(len(got), k)
        assert counts[i] == n
        assert top[i, :n].tolist() == got[:n] and near[i, :n].tolist() == dist[:n]
        assert (top[i, n:] == -1).all() and torch.isinf(near[i, n:]).all()


def _batch(device="cpu"):
    """Three clouds: ordinary, one with queries but no reference point, one with
    reference points but no query."""
    g = torch.Generator().manual_seed(3)
    q_sizes, r_sizes = [40, 9, 0], [120, 0, 50]
    p_query = torch.randn(sum(q_sizes), 3, generator=g)
    p_ref = torch.randn(sum(r_sizes), 3, generator=g)
    q_off = ek.ops.batches.offsets_from_lengths(torch.tensor(q_sizes))
    r_off = ek.ops.batches.offsets_from_lengths(torch.tensor(r_sizes))
    return [t.to(device) for t in (p_query, p_ref, q_off, r_off)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
def test_batched_search_stays_in_each_cloud(device, backend):
    search = functools.partial(ek.radius_search, backend=backend)
    p_query, p_ref, q_off, r_off = _batch(device)
    offsets, indices, distances = search(
        p_query, p_ref, 0.8, query_offsets=q_off, ref_offsets=r_off
    )
    rows = _rows(offsets, indices, distances)
    for b in range(3):
        q0, q1, r0, r1 = q_off[b], q_off[b + 1], r_off[b], r_off[b + 1]
        cloud = rows[q0:q1]
        _assert_matches_scipy(p_query[q0:q1], p_ref[r0:r1], cloud, 0.8, shift=int(r0))
    _assert_sorted(rows)
    assert offsets[q_off[1]] == offsets[q_off[2]]  # cloud 1 has no reference point
    top, _, counts = search(
        p_query, p_ref, 0.8, max_neighbours=4, query_offsets=q_off, ref_offsets=r_off
    )
    for i, (got, _) in enumerate(rows):
        assert top[i, : counts[i]].tolist() == got[:4]


# ------------------------------------------------------------------- gradients


def _float64(kind="random"):
    p_query, p_ref = _clouds(kind)
    return p_query[:12].double().requires_grad_(), p_ref.double().requires_grad_()


def test_gradcheck_of_the_csr_distances_in_both_clouds():
    p_query, p_ref = _float64()
    assert torch.autograd.gradcheck(
        lambda q, r: ek.radius_search(q, r, RADIUS)[2], (p_query, p_ref)
    )


def test_gradcheck_of_the_padded_distances_in_both_clouds():
    p_query, p_ref = _float64()

    def used(q, r):
        indices, distances, _ = ek.radius_search(q, r, RADIUS, max_neighbours=6)
        return torch.where(indices >= 0, distances, 0.0)

    assert torch.autograd.gradcheck(used, (p_query, p_ref))


def test_batched_gradcheck():
    p_query, p_ref, q_off, r_off = _batch()
    p_query = p_query.double().requires_grad_()
    p_ref = p_ref.double().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, r: ek.radius_search(
            q, r, 0.8, query_offsets=q_off, ref_offsets=r_off
        )[2],
        (p_query, p_ref),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
def test_float32_gradients_match_float64_and_stay_finite_at_zero(device, backend):
    # the backend's float32 gradients against the torch backend's in float64
    p_query, p_ref = _clouds("self", device)  # every query at distance 0 of itself
    grads = []
    for dtype, name in ((torch.float32, backend), (torch.float64, "torch")):
        q = p_query.detach().to(dtype).requires_grad_()
        r = p_ref.detach().to(dtype).requires_grad_()
        _, _, distances = ek.radius_search(q, r, RADIUS, backend=name)
        (distances * distances.detach().cos()).sum().backward()
        grads.append((q.grad, r.grad))
    for got, want in zip(*grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)


def test_second_order_gradients_exist():
    p_query, p_ref = _float64()
    assert torch.autograd.gradgradcheck(
        lambda q, r: ek.radius_search(q, r, RADIUS)[2], (p_query, p_ref)
    )


# ---------------------------------------------- operators, compiler and export


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padded", [False, True], ids=["csr", "padded"])
def test_opcheck(padded, device):
    p_query, p_ref = _clouds("duplicates", device)
    p_query.requires_grad_()
    p_ref.requires_grad_()
    if padded:
        args = (p_query, p_ref, RADIUS, 5, None, None, None)
        torch.library.opcheck(radius_search_padded, args)
    else:
        torch.library.opcheck(radius_search_csr, (p_query, p_ref, RADIUS))
    q_off, r_off = (torch.tensor([0, 30, 70]), torch.tensor([0, 100, 300]))
    batched = (p_query, p_ref, RADIUS, q_off.to(device), r_off.to(device))
    torch.library.opcheck(radius_search_csr, batched)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["random", "duplicates", "self", "far"])
def test_the_fused_search_gives_the_torch_lists(kind, device):
    # equal distances tie by the lower index on both: the same lists, not only sets
    p_query, p_ref = _clouds(kind, device)
    m, n = p_query.shape[0], p_ref.shape[0]
    q_off, r_off = torch.tensor([0, m // 3, m]), torch.tensor([0, n // 3, n])
    for batch in (
        {},
        {"query_offsets": q_off.to(device), "ref_offsets": r_off.to(device)},
    ):
        for k in (None, 5):
            theirs = ek.radius_search(p_query, p_ref, RADIUS, max_neighbours=k, **batch)
            ours = ek.radius_search(
                p_query, p_ref, RADIUS, max_neighbours=k, backend="fused", **batch
            )
            distances = 2 if k is None else 1
            for i, (got, want) in enumerate(zip(ours, theirs, strict=True)):
                if i == distances:
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
                else:
                    assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padded", [False, True], ids=["csr", "padded"])
def test_opcheck_of_the_fused_operators(padded, device):
    ek.backends("radius_search")  # registered
    registry.get("fused").prepare()
    ops = torch.ops.extkernels_fused
    p_query, p_ref = _clouds("duplicates", device)
    p_query.requires_grad_()
    p_ref.requires_grad_()
    q_off, r_off = torch.tensor([0, 30, 70]), torch.tensor([0, 100, 300])
    batch = (q_off.to(device), r_off.to(device))
    if padded:
        torch.library.opcheck(ops.radius_search_padded, (p_query, p_ref, RADIUS, 5))
        torch.library.opcheck(
            ops.radius_search_padded, (p_query, p_ref, RADIUS, 5, *batch)
        )
    else:
        torch.library.opcheck(ops.radius_search, (p_query, p_ref, RADIUS))
        torch.library.opcheck(ops.radius_search, (p_query, p_ref, RADIUS, *batch))


def test_the_fused_second_order_matches_the_torch_one():
    p_query, p_ref = _clouds("random")
    grads = []
    for backend in ("torch", "fused"):
        q, r = p_query.clone().requires_grad_(), p_ref.clone().requires_grad_()
        _, _, distances = ek.radius_search(q, r, RADIUS, backend=backend)
        (g,) = torch.autograd.grad((distances**2).sum(), q, create_graph=True)
        grads.append(torch.autograd.grad(g.pow(2).sum(), (q, r)))
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_fused_search_takes_float32_only():
    p_query, p_ref = _clouds("random")
    with pytest.raises(TypeError, match="p_query: expected dtype torch.float32"):
        ek.radius_search(p_query.double(), p_ref.double(), RADIUS, backend="fused")


def test_the_registry_lists_the_operation_and_its_operator():
    assert "torch" in ek.backends("radius_search")
    torch_backend = registry.get("torch")
    assert torch_backend.operator("radius_search") is (
        torch.ops.extkernels_torch.radius_search.default
    )
    assert torch_backend.has_autograd("radius_search")
    assert "radius_search" not in registry.OPERATIONS  # the projector's are apart
    fused = registry.get("fused")
    assert "fused" in ek.backends("radius_search")
    assert fused.operator("radius_search") is (
        torch.ops.extkernels_fused.radius_search.default
    )
    assert fused.has_autograd("radius_search")


def _loss(p_query, p_ref, weights, backend="torch"):
    search = functools.partial(ek.radius_search, backend=backend)
    offsets, indices, distances = search(p_query, p_ref, RADIUS)
    per_edge = distances * weights[indices]
    top, near, counts = search(p_query, p_ref, RADIUS, max_neighbours=4)
    padded = torch.where(top >= 0, near, 0.0).sum()
    return per_edge.sum() + padded + offsets[-1] + counts.sum()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiles_with_fullgraph_and_matches_eager(dynamic, device, backend):
    torch._dynamo.reset()
    p_query, p_ref = _clouds("duplicates", device)
    weights = torch.linspace(0.5, 1.5, p_ref.shape[0], device=device)
    loss = functools.partial(_loss, backend=backend)
    compiled = torch.compile(loss, fullgraph=True, dynamic=dynamic)
    results = []
    for fn in (loss, compiled):
        q, r = p_query.clone().requires_grad_(), p_ref.clone().requires_grad_()
        value = fn(q, r, weights)
        results.append((value.detach(), *torch.autograd.grad(value, (q, r))))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_caller_may_change_max_neighbours(device, backend):
    # The second value makes it a SymInt in the traced graph: the check takes it, each
    # value's lists match eager, and a value below one is refused by name.
    torch._dynamo.reset()
    p_query, p_ref = _clouds("duplicates", device)

    def search(max_neighbours):
        return ek.radius_search(
            p_query, p_ref, RADIUS, max_neighbours=max_neighbours, backend=backend
        )

    compiled = torch.compile(search, fullgraph=True)
    for max_neighbours in (3, 4, 6):
        got, want = compiled(max_neighbours), search(max_neighbours)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
    with pytest.raises(Exception, match=r"max_neighbours: expected an int >= 1"):
        compiled(0)


class _Neighbours(torch.nn.Module):
    def __init__(self, backend="torch"):
        super().__init__()
        self.backend = backend

    def forward(self, p_query, p_ref):
        search = functools.partial(ek.radius_search, backend=self.backend)
        offsets, indices, distances = search(p_query, p_ref, RADIUS)
        top, _, counts = search(p_query, p_ref, RADIUS, max_neighbours=3)
        return offsets, indices, distances, top, counts


@pytest.mark.parametrize("backend", BACKENDS)
def test_export_runs_and_matches(backend):
    p_query, p_ref = _clouds("random")
    program = torch.export.export(_Neighbours(backend), (p_query, p_ref))
    targets = {str(n.target) for n in program.graph.nodes}
    assert f"extkernels_{backend}.radius_search.default" in targets
    other_query, other_ref = _clouds("duplicates", seed=1)
    for args in ((p_query, p_ref), (other_query, other_ref)):
        got = program.module()(*args)
        for g, w in zip(got, _Neighbours(backend)(*args), strict=True):
            assert torch.equal(g, w)


class _MeanDistance(torch.nn.Module):
    """Each query's mean distance to its neighbours in its own cloud: code on tensors
    of the data-dependent size E after the search."""

    def __init__(self, backend="torch"):
        super().__init__()
        self.backend = backend

    def forward(self, p_query, p_ref, query_offsets, ref_offsets):
        offsets, indices, distances = ek.radius_search(
            p_query,
            p_ref,
            RADIUS,
            query_offsets=query_offsets,
            ref_offsets=ref_offsets,
            backend=self.backend,
        )
        rows = torch.arange(p_query.shape[0], device=p_query.device)
        rows = rows.repeat_interleave(offsets.diff(), output_size=indices.shape[0])
        sums = distances.new_zeros(p_query.shape[0]).index_add(0, rows, distances)
        return sums / offsets.diff().clamp_min(1)


def _packed(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    points = torch.randn(sum(sizes), 3, generator=g)
    return points, ek.ops.batches.offsets_from_lengths(torch.tensor(sizes))


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_aotinductor_package_runs_other_batches(backend, tmp_path):
    points, offsets = _packed([100, 200], seed=0)
    # the fused kernels take at most 2**28 - 1 points: a bound the export keeps
    n = torch.export.Dim("n", min=2, max=10**6)
    clouds = torch.export.Dim("clouds", min=2)
    program = torch.export.export(
        _MeanDistance(backend),
        (points, points, offsets, offsets),
        dynamic_shapes=({0: n}, {0: n}, {0: clouds}, {0: clouds}),
    )
    path = torch._inductor.aoti_compile_and_package(
        program, package_path=str(tmp_path / "mean_distance.pt2")
    )
    runner = torch._inductor.aoti_load_package(path)
    for sizes, seed in (([100, 200], 0), ([250, 50, 120], 1)):
        points, offsets = _packed(sizes, seed)
        args = (points, points, offsets, offsets)
        torch.testing.assert_close(runner(*args), _MeanDistance(backend)(*args))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_neighbours, syncs", [(None, 1), (8, 0)])
def test_the_csr_form_waits_for_the_device_once(max_neighbours, syncs, backend):
    # the one copy to the host that sizes E; the padded form's sizes are its inputs'.
    # Counted as the runtime's stream synchronisations (a C++ operator's waits raise no
    # Python warning), beside one known wait that shows the count sees them.
    p_query, p_ref = _clouds("random", "cuda")
    ek.radius_search(
        p_query, p_ref, RADIUS, max_neighbours=max_neighbours, backend=backend
    )  # warm
    known = torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with value_checks(False), torch.profiler.profile(activities=activities) as prof:
        ek.radius_search(
            p_query, p_ref, RADIUS, max_neighbours=max_neighbours, backend=backend
        )
        known.item()
    waits = profiling.runtime_calls(prof, ("cudaStreamSynchronize",))["calls"].sum()
    assert waits == syncs + 1


# ------------------------------------------------------------------ bad inputs


def _valid():
    p_query, p_ref, q_off, r_off = _batch()
    return {"p_query": p_query, "p_ref": p_ref, "q": q_off, "r": r_off}


def _bad_cases():
    """``(label, change the valid inputs into the call's arguments, argument, error,
    whether a fake sees it)``."""

    def call(v, **changes):
        args = {
            "p_query": v["p_query"],
            "p_ref": v["p_ref"],
            "radius": RADIUS,
            "max_neighbours": None,
            "query_offsets": v["q"],
            "ref_offsets": v["r"],
        }
        args.update(changes)
        return args

    def nan(v):
        return v["p_ref"].clone().index_fill_(0, torch.tensor([2]), math.nan)

    return [
        (
            "int query",
            lambda v: call(v, p_query=v["p_query"].long()),
            "p_query",
            TypeError,
            True,
        ),
        (
            "flat query",
            lambda v: call(v, p_query=v["p_query"][:, :2].contiguous()),
            "p_query",
            ValueError,
            True,
        ),
        (
            "strided ref",
            lambda v: call(v, p_ref=v["p_ref"].repeat(1, 2)[:, ::2]),
            "p_ref",
            ValueError,
            False,
        ),
        ("nan ref", lambda v: call(v, p_ref=nan(v)), "p_ref", ValueError, False),
        (
            "inf query",
            lambda v: call(v, p_query=v["p_query"].clone().fill_(math.inf)),
            "p_query",
            ValueError,
            False,
        ),
        (
            "float64 ref",
            lambda v: call(v, p_ref=v["p_ref"].double()),
            "p_ref",
            TypeError,
            True,
        ),
        (
            "meta ref",
            lambda v: call(v, p_ref=v["p_ref"].to("meta")),
            "p_ref",
            ValueError,
            False,
        ),
        ("zero radius", lambda v: call(v, radius=0.0), "radius", ValueError, True),
        ("negative radius", lambda v: call(v, radius=-1.0), "radius", ValueError, True),
        (
            "infinite radius",
            lambda v: call(v, radius=math.inf),
            "radius",
            ValueError,
            True,
        ),
        ("nan radius", lambda v: call(v, radius=math.nan), "radius", ValueError, True),
        (
            "zero max_neighbours",
            lambda v: call(v, max_neighbours=0),
            "max_neighbours",
            ValueError,
            True,
        ),
        (
            "float max_neighbours",
            lambda v: call(v, max_neighbours=2.0),
            "max_neighbours",
            TypeError,
            False,
        ),
        (
            "float offsets",
            lambda v: call(v, query_offsets=v["q"].float()),
            "query_offsets",
            TypeError,
            True,
        ),
        (
            "offsets from 1",
            lambda v: call(v, query_offsets=v["q"] + 1),
            "query_offsets",
            ValueError,
            False,
        ),
        (
            "short offsets",
            lambda v: call(v, ref_offsets=v["r"] - torch.tensor([0, 0, 0, 1])),
            "ref_offsets",
            ValueError,
            False,
        ),
        (
            "decreasing offsets",
            lambda v: call(v, ref_offsets=torch.tensor([0, 130, 120, 170])),
            "ref_offsets",
            ValueError,
            False,
        ),
        (
            "clouds differ",
            lambda v: call(v, ref_offsets=torch.tensor([0, 170])),
            "query_offsets, ref_offsets",
            ValueError,
            True,
        ),
        (
            "one offsets",
            lambda v: call(v, ref_offsets=None),
            "ref_offsets",
            ValueError,
            True,
        ),
    ]


BAD = [pytest.param(*case[1:], id=case[0]) for case in _bad_cases()]


@pytest.mark.parametrize("make, name, error, fake", BAD)
def test_entry_point_rejects(make, name, error, fake):
    args = make(_valid())
    p_query, p_ref, radius = args.pop("p_query"), args.pop("p_ref"), args.pop("radius")
    with pytest.raises(error, match=f"^{name}:"):
        ek.radius_search(p_query, p_ref, radius, **args)


def _operator_call(args):
    k = args["max_neighbours"]
    rest = (args["query_offsets"], args["ref_offsets"], None)
    if k is None:
        return radius_search_csr, (
            args["p_query"],
            args["p_ref"],
            args["radius"],
            *rest,
        )
    return radius_search_padded, (
        args["p_query"],
        args["p_ref"],
        args["radius"],
        k,
        *rest,
    )


@pytest.mark.parametrize("make, name, error, fake", BAD)
def test_operator_rejects(make, name, error, fake):
    args = make(_valid())
    if isinstance(args["max_neighbours"], float):
        pytest.skip("the operator's schema takes an int")
    op, call = _operator_call(args)
    if any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in call):
        pytest.skip("the operator has no kernel for meta tensors")
    with pytest.raises(error, match=f"^{name}:"):
        op(*call)


@pytest.mark.parametrize("make, name, error, fake", BAD)
def test_fake_rejects(make, name, error, fake):
    if not fake:
        pytest.skip("a fake checks neither values nor the layout")
    op, call = _operator_call(make(_valid()))
    with FakeTensorMode() as mode:
        fakes = [
            mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in call
        ]
        with pytest.raises(error, match=f"^{name}:"):
            op(*fakes)


# ------------------------------------------------------------------ kNN graph


@pytest.mark.parametrize("device", DEVICES)
def test_knn_graph_lists_each_query_with_its_neighbours(device):
    p_query, p_ref = _clouds("random", device)
    edges = ek.knn_graph(p_query, p_ref, 4)
    _, indices = ek.knn(p_query, p_ref, 4)
    assert edges.shape == (2, p_query.shape[0] * 4) and edges.dtype == torch.int64
    rows = torch.arange(p_query.shape[0], device=device).repeat_interleave(4)
    assert torch.equal(edges[0], rows)
    assert torch.equal(edges[1], indices.reshape(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_batched_knn_graph_stays_in_each_cloud(device):
    p_query, p_ref, q_off, r_off = _batch(device)
    q_off = torch.tensor([0, 40, 40, 49], device=device)  # queries in clouds 0 and 2
    edges = ek.knn_graph(p_query, p_ref, 3, query_offsets=q_off, ref_offsets=r_off)
    assert edges.shape == (2, 49 * 3)
    for b in (0, 2):
        q0, q1, r0, r1 = q_off[b], q_off[b + 1], r_off[b], r_off[b + 1]
        _, want = ek.knn(p_query[q0:q1], p_ref[r0:r1], 3)
        mine = (edges[0] >= q0) & (edges[0] < q1)
        assert torch.equal(edges[1, mine], want.reshape(-1) + r0)


def test_batched_knn_graph_needs_k_points_in_each_cloud_with_queries():
    p_query, p_ref, q_off, r_off = _batch()
    with pytest.raises(ValueError, match="^ref_offsets: expected cloud 1"):
        ek.knn_graph(p_query, p_ref, 3, query_offsets=q_off, ref_offsets=r_off)
    with pytest.raises(ValueError, match="^ref_offsets:"):
        ek.knn_graph(p_query, p_ref, 3, query_offsets=q_off)
    with pytest.raises(ValueError, match="^k:"):
        ek.knn_graph(p_query, p_ref, 0, query_offsets=q_off, ref_offsets=r_off)
