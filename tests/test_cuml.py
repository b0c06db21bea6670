"""What is specific to the ``cuml`` backend: its operator's registration and tracing,
chapter 3's measurements of it, and, where a CUDA GPU with cuML is present, the
ownership of its outputs. The conformance suite (tests/test_backends.py) covers
exactness, bad inputs, fakes, opcheck and compilation."""

import pandas as pd
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import extkernels
from extkernels.experiments import cuml_search
from extkernels.ops import cuml as cuml_backend

HAS_CUML = cuml_backend.available()


def test_operator_is_registered_with_the_cudagraph_unsafe_tag():
    op = torch.ops.cuml.knn.default
    assert str(op._schema).startswith(
        'cuml::knn(Tensor p_query, Tensor p_ref, SymInt k, str algorithm="rbc")'
    )
    if hasattr(torch.Tag, "cudagraph_unsafe"):
        assert torch.Tag.cudagraph_unsafe in op.tags


@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (10, 50, 7), (27, 8, 8)])
def test_fake_implementation_gives_shapes_dtypes_and_device(m, n, k):
    with FakeTensorMode():
        d, i = torch.ops.cuml.knn(
            torch.empty(m, 3, device="cuda"), torch.empty(n, 3, device="cuda"), k
        )
    assert (tuple(d.shape), tuple(i.shape)) == ((m, k), (m, k))
    assert (d.dtype, i.dtype) == (torch.float32, torch.int64)
    assert d.device.type == i.device.type == "cuda"


def test_operator_traces_as_one_opaque_node():
    def search(p_query, p_ref):
        distances, indices = torch.ops.cuml.knn(p_query, p_ref, 4)
        return distances.sum() + indices.sum()

    graph = make_fx(search, tracing_mode="fake")(torch.randn(6, 3), torch.randn(9, 3))
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.cuml.knn.default) == 1


def test_backend_is_listed_only_where_it_can_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "cuml" not in extkernels.backends("knn")
    assert "cuml" not in extkernels.backends("knn_aggregate")


def test_backend_rejects_cpu_tensors():
    p_query, p_ref = extkernels.query_grid(3), extkernels.reference_cloud(20)
    with pytest.raises(ValueError, match="^backend: 'cuml' runs on cuda"):
        extkernels.knn(p_query, p_ref, 3, backend="cuml")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUML, reason="needs a CUDA GPU with cuML")
def test_outputs_are_fresh_tensors_owned_by_pytorch():
    p_ref = extkernels.reference_cloud(500, device="cuda")
    p_query = extkernels.query_grid(4, device="cuda")
    distances, indices = torch.ops.cuml.knn(p_query, p_ref, 5)
    inputs = {p_query.untyped_storage().data_ptr(), p_ref.untyped_storage().data_ptr()}
    assert distances.untyped_storage().data_ptr() not in inputs
    assert indices.untyped_storage().data_ptr() not in inputs


def test_centring_keeps_every_distance():
    p_ref = extkernels.reference_cloud(200) + 1000.0
    p_query = extkernels.query_grid(3) + 1000.0
    q, r = cuml_backend.ops.centred(p_query, p_ref)
    assert r.mean(dim=0).abs().max() < 1e-3
    # differences of nearby float32 numbers are exact: the centred clouds differ by the
    # same
    torch.testing.assert_close(
        q[:, None] - r[None], p_query[:, None] - p_ref[None], rtol=0, atol=0
    )


def test_exact_distances_sort_the_neighbours_found():
    p_ref, p_query = extkernels.reference_cloud(50), extkernels.query_grid(3)
    found = torch.stack(
        [
            torch.randperm(50, generator=torch.Generator().manual_seed(i))[:6]
            for i in range(p_query.shape[0])
        ]
    )
    d, i = cuml_backend.ops.exact_distances(p_query, p_ref, found)
    assert bool((d[:, 1:] >= d[:, :-1]).all())
    assert all(
        set(a) == set(b) for a, b in zip(i.tolist(), found.tolist(), strict=True)
    )
    torch.testing.assert_close(d, (p_query[:, None] - p_ref[i]).norm(dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUML, reason="needs a CUDA GPU with cuML")
@pytest.mark.parametrize("as_op", [True, False], ids=["operator", "direct"])
@pytest.mark.parametrize("algorithm", cuml_backend.ALGORITHMS)
def test_far_from_the_origin_rbc_is_exact_and_brute_misses_only_near_ties(
    algorithm, as_op
):
    # The book's size, around (1000, 1000, 1000): uncentred, cuML's float32 expanded
    # form returns a wrong neighbour set for about half of these queries. Centred, the
    # random ball cover is exact; brute force still computes the expanded form, whose
    # rounding can swap two neighbours at nearly equal distances (about 1 query in 7,000
    # here).
    p_ref = extkernels.reference_cloud(100_000, device="cuda") + 1000.0
    p_query = extkernels.query_grid(30, device="cuda") + 1000.0
    d, i = extkernels.knn(
        p_query, p_ref, 7, backend="cuml", as_op=as_op, algorithm=algorithm
    )
    d_ref, i_ref = extkernels.knn(p_query, p_ref, 7, chunk_size=2000)
    wrong = (i.sort(dim=1).values != i_ref.sort(dim=1).values).any(dim=1)
    if algorithm == "rbc":
        assert not wrong.any()
        torch.testing.assert_close(d, d_ref, rtol=1e-6, atol=1e-6)
    else:
        assert float(wrong.float().mean()) < 1e-3
        # the k-th neighbour found is never farther than the true one by more than a
        # near tie
        assert float((d[:, -1] - d_ref[:, -1]).abs().max()) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUML, reason="needs a CUDA GPU with cuML")
def test_auto_choice_names_one_of_cumls_searches():
    p_ref = extkernels.reference_cloud(20_000, device="cuda")
    choice = cuml_backend.auto_choice(p_ref, 7)
    assert choice in {"brute", "rbc", "ivfflat", "ivfpq"}


def test_the_listed_search_and_fake_are_public_and_the_fake_checks_k():
    assert {"search", "knn_fake", "knn_op"} <= set(cuml_backend.__all__)
    assert cuml_backend.search is cuml_backend.ops.search
    # register_fake hands the function back: chapter 3 lists it under the operator
    with FakeTensorMode():
        p_query = torch.empty(4, 3, device="cuda")
        p_ref = torch.empty(9, 3, device="cuda")
        d, i = cuml_backend.knn_fake(p_query, p_ref, 2)
        with pytest.raises(ValueError):
            cuml_backend.knn_fake(p_query, p_ref, 10)
    assert (tuple(d.shape), i.dtype) == ((4, 2), torch.int64)


def test_wrong_sets_ignore_order_within_a_row_and_count_other_sets():
    exact = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 4, 8]])
    found = torch.tensor([[2, 0, 1], [3, 4, 9], [8, 7, 6], [0, 4, 7]])
    wrong = cuml_search.wrong_sets(found, exact)
    assert wrong.tolist() == [False, True, False, True]
    assert cuml_search.wrong_pct(found, exact) == 50.0
    assert cuml_search.wrong_pct(exact, exact) == 0.0
    with pytest.raises(ValueError, match="^indices: expected the shape of exact"):
        cuml_search.wrong_sets(found[:, :2], exact)


def _table(rows: dict[str, tuple[float, float, float]]) -> pd.DataFrame:
    """A timing table with (median, min, max) forward ms per variant; training ms
    twice that, and speedups over ``knn/torch``."""
    df = pd.DataFrame(
        {
            name: {
                "forward_ms": m,
                "forward_min": lo,
                "forward_max": hi,
                "train_ms": 2 * m,
                "train_min": 2 * lo,
                "train_max": 2 * hi,
            }
            for name, (m, lo, hi) in rows.items()
        }
    ).T
    df["forward_speedup"] = df.loc["knn/torch", "forward_ms"] / df["forward_ms"]
    return df


def test_chapter_3_timing_numbers_quote_the_table():
    table = _table(
        {
            "knn/torch": (80.0, 79.0, 81.0),
            "knn/cuml": (9.0, 8.5, 9.5),
            "knn/cuml+compile": (10.0, 9.5, 10.5),
            "knn/cuml-op": (11.0, 10.0, 12.0),
            "knn/cuml-op+compile": (10.0, 9.0, 11.0),
        }
    )
    numbers = cuml_search.timing_numbers(table)
    assert numbers == {"cuml_speedup": 8.0, "cuml_fwd_ms": 10.0}
    assert all(type(v) is float for v in numbers.values())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUML, reason="needs a CUDA GPU with cuML")
def test_compare_searches_times_both_exact_searches():
    p_ref = extkernels.reference_cloud(5_000, device="cuda")
    p_query = extkernels.query_grid(8, device="cuda")
    table = cuml_search.compare_searches(p_query, p_ref, 5, n_iters=2)
    assert list(table.index) == list(cuml_backend.ALGORITHMS)
    assert (table["ms per search"] > 0).all()
    assert table.loc["rbc", "queries with a wrong neighbour"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUML, reason="needs a CUDA GPU with cuML")
def test_operator_parts_time_each_part_of_the_operator_in_turn():
    p_ref = extkernels.reference_cloud(5_000, device="cuda")
    p_query = extkernels.query_grid(8, device="cuda")
    table = cuml_search.operator_parts(p_query, p_ref, 5, n_iters=2, repeats=3)
    assert list(table.index) == list(cuml_search.PARTS)
    assert (table["min"] <= table["ms per call"]).all()
    assert (table["ms per call"] <= table["max"]).all()
    assert table["added ms"].iloc[1:].notna().all()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUML, reason="needs a CUDA GPU with cuML")
def test_every_part_of_the_operator_finds_the_same_neighbours():
    p_ref = extkernels.reference_cloud(5_000, device="cuda")
    p_query = extkernels.query_grid(8, device="cuda")
    _, exact = extkernels.knn(p_query, p_ref, 5)
    for name, options in cuml_search.PARTS.items():
        if options is None:
            continue
        d, i = cuml_search._search_with(p_query, p_ref, 5, **options)
        assert cuml_search.wrong_pct(i, exact) == 0.0, name
        want = (p_query[:, None] - p_ref[i]).norm(dim=-1)
        torch.testing.assert_close(d, want, atol=1e-3, rtol=1e-3, msg=name)
