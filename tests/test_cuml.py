"""The cuML backend: registration, fake implementation and input checks everywhere; the real
search where a CUDA GPU with cuML is present."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import extkernels
from extkernels.ops import cuml_backend

HAS_CUML = cuml_backend.available()
needs_cuml = pytest.mark.skipif(not HAS_CUML, reason="needs a CUDA GPU with cuML")


def test_operator_is_registered_with_the_cudagraph_unsafe_tag():
    op = torch.ops.cuml.knn.default
    assert str(op._schema).startswith("cuml::knn(Tensor p_query, Tensor p_ref, SymInt k)")
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


@pytest.mark.parametrize(
    "q_shape, r_shape, k, dtype, error, name",
    [
        ((10, 3), (5, 3), 6, torch.float32, ValueError, "k"),
        ((10, 3), (5, 3), 0, torch.float32, ValueError, "k"),
        ((10, 2), (5, 3), 1, torch.float32, ValueError, "p_query"),
        ((10, 3), (0, 3), 1, torch.float32, ValueError, "p_ref"),
        ((10, 3), (5, 3), 1, torch.float64, TypeError, "p_query"),
    ],
)
def test_fake_implementation_rejects_bad_input(q_shape, r_shape, k, dtype, error, name):
    # The fake runs the real operator's metadata checks, so a compiled caller fails at trace time.
    with FakeTensorMode(), pytest.raises(error, match=f"^{name}:"):
        torch.ops.cuml.knn(
            torch.empty(q_shape, dtype=dtype, device="cuda"), torch.empty(r_shape, device="cuda"), k
        )


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


@needs_cuml
def test_search_matches_the_kd_tree():
    p_ref = extkernels.reference_cloud(5_000, device="cuda")
    p_query = extkernels.query_grid(8, device="cuda")
    distances, indices = extkernels.knn(p_query, p_ref, 7, backend="cuml")
    assert extkernels.reference.validate_knn(p_query, p_ref, distances, indices, 7, atol=1e-3)


@needs_cuml
def test_outputs_are_fresh_tensors_owned_by_pytorch():
    p_ref = extkernels.reference_cloud(500, device="cuda")
    p_query = extkernels.query_grid(4, device="cuda")
    distances, indices = torch.ops.cuml.knn(p_query, p_ref, 5)
    inputs = {p_query.untyped_storage().data_ptr(), p_ref.untyped_storage().data_ptr()}
    assert distances.untyped_storage().data_ptr() not in inputs
    assert indices.untyped_storage().data_ptr() not in inputs


@needs_cuml
def test_opcheck():
    p_ref = extkernels.reference_cloud(2_000, device="cuda")
    p_query = extkernels.query_grid(6, device="cuda")
    torch.library.opcheck(torch.ops.cuml.knn.default, (p_query, p_ref, 7))


@needs_cuml
def test_projector_compiles_without_graph_break():
    p_ref = extkernels.reference_cloud(2_000, device="cuda")
    p_query = extkernels.query_grid(6, device="cuda")
    model = extkernels.Projector(extkernels.KnnAggregation(backend="cuml")).cuda()
    explanation = torch._dynamo.explain(model)(p_query, p_ref)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)
    torch.testing.assert_close(
        torch.compile(model, fullgraph=True)(p_query, p_ref), model(p_query, p_ref)
    )
