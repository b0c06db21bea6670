"""Export and AOTInductor packages of the projector on the CPU: the C++ operators
export as themselves and survive decomposition; a package runs in a fresh process that
loads only the operator libraries, fails there with PyTorch's error without them, and
a Python-defined operator runs there only where its Python is imported."""

import functools
import os

import pytest
import torch

import extkernels
from extkernels.experiments import shipping
from extkernels.models import KnnAggregation, Projector, RadiusAggregation
from extkernels.ops.cpp import build as cpp_build
from extkernels.ops.fused import build as fused_build

pytestmark = pytest.mark.slow


def _model(aggregation):
    torch.manual_seed(0)
    return Projector(aggregation, hidden=8).eval()


INPUTS = (extkernels.query_grid(4), extkernels.reference_cloud(200, seed=0))


@pytest.mark.parametrize(
    "aggregation, expected",
    [
        (KnnAggregation(5, 0.1, backend="cpp"), "extkernels_cpp::knn_aggregate_fwd"),
        (
            KnnAggregation(5, 0.1, backend="fused"),
            "extkernels_fused::knn_aggregate_fwd",
        ),
        (RadiusAggregation(0.3, 0.1, backend="warp"), "warp::radius_aggregate"),
    ],
    ids=["cpp", "fused", "warp"],
)
def test_the_operators_export_as_themselves_and_survive_decomposition(
    aggregation, expected
):
    model = _model(aggregation)
    with torch.no_grad():
        eager = model(*INPUTS)  # loads the backend's library before the trace
    ep = torch.export.export(model, INPUTS)
    assert [n.split(".")[0] for n in shipping.operator_nodes(ep)] == [expected]
    decomposed = ep.run_decompositions()
    assert shipping.operator_nodes(decomposed) == shipping.operator_nodes(ep)
    torch.testing.assert_close(decomposed.module()(*INPUTS), eager)


def _packaged(aggregation, path):
    """The model around ``aggregation`` packaged into ``path``, and its eager output."""
    model = _model(aggregation)
    with torch.no_grad():
        expected = model(*INPUTS)
    return shipping.package(model, INPUTS, path), expected


@pytest.fixture(scope="module")
def fused_package(tmp_path_factory):
    path = tmp_path_factory.mktemp("pt2") / "fused.pt2"
    return _packaged(KnnAggregation(5, 0.1, backend="fused"), path)


def test_a_package_runs_in_a_fresh_process_with_the_libraries_alone(fused_package):
    pt2, expected = fused_package
    libraries = [cpp_build.library_file(), fused_build.library_file()]
    ran = shipping.run_fresh(pt2, INPUTS, expected, libraries=libraries, seconds=0.01)
    assert ran["error"] is None and ran["max_abs_diff"] < 1e-5 and ran["ms"] > 0
    bare = shipping.run_fresh(pt2, INPUTS, expected, seconds=None)
    assert "Could not find schema for extkernels_" in bare["error"]


def test_a_python_operator_in_a_package_needs_its_python(tmp_path):
    aggregation = RadiusAggregation(0.3, 0.1, backend="warp")
    pt2, expected = _packaged(aggregation, tmp_path / "warp.pt2")
    bare = shipping.run_fresh(pt2, INPUTS, expected, seconds=None)
    assert "cannot be run via AOTI without Python" in bare["error"]
    ran = shipping.run_fresh(
        pt2, INPUTS, expected, imports=["extkernels.ops.warp"], seconds=None
    )
    assert ran["error"] is None and ran["max_abs_diff"] < 1e-5


def test_a_package_runs_from_cpp_with_the_libraries_it_calls(fused_package):
    pt2, expected = fused_package
    both = [cpp_build.library_file(), fused_build.library_file()]
    ran = shipping.run_cpp(pt2, INPUTS, expected, libraries=both)
    assert ran["error"] is None and ran["max_abs_diff"] < 1e-5 and ran["ms"] > 0
    # the fused CPU search reaches the C++ backend's gather through the dispatcher
    alone = shipping.run_cpp(pt2, INPUTS, expected, libraries=both[1:])
    assert alone["error"] == "Could not find schema for extkernels_cpp::gather."
    bare = shipping.run_cpp(pt2, INPUTS, expected)
    assert bare["error"].startswith("Could not find schema for extkernels_fused::")


def test_every_backend_packages_and_runs_where_its_operators_exist(tmp_path):
    # one backend per lesson: the page's CPU run packages the same three
    backends = ["triton", "cpp", "warp"]
    table = shipping.package_table(extkernels.problem(), tmp_path, backends)["outcome"]
    # a C++ operator needs its library, nothing else
    assert "Could not find schema for extkernels_cpp::" in table["cpp", "nothing"]
    assert table["cpp", "its libraries"].startswith("runs")
    # a Python operator needs its Python, and says so
    assert "without Python" in table["warp", "nothing"]
    assert table["warp", "and its Python"].startswith("runs")
    # a triton_op needs nothing, as PyTorch's own operators need nothing
    assert table["triton", "nothing"].startswith("runs")
    assert ("triton", "its libraries") not in table.index  # it has none
    assert list(table.index.unique("backend")) == backends  # in the order asked


def test_the_export_table_names_each_backends_operator():
    table = shipping.export_table(extkernels.problem())
    assert table.at["cpp", "exported"] == "extkernels_cpp::knn_aggregate_fwd"
    assert table.at["warp", "after run_decompositions"].startswith("warp::")
    assert table.at["torch", "exported"] == "none: ATen only"


def test_outcome_words_a_run():
    assert shipping.outcome({"error": "RuntimeError: Could not find"}) == (
        "Could not find"
    )
    assert shipping.outcome({"error": None, "max_abs_diff": 0.0}) == (
        "runs (max |diff| 0e+00)"
    )


def test_a_packaged_variant_times_forward_passes_only(small_problem):
    from extkernels import variants

    row = variants.run(variants.get("knn/cpp+aoti"), small_problem)
    assert row["forward_ms"] > 0 and row["first_call_s"] > 0
    assert row["train_ms"] != row["train_ms"]  # NaN: a package has no backward


def test_just_in_time_leaves_the_wheel_unused_and_empties_the_cache_when_cold(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(shipping.tempfile, "gettempdir", lambda: str(tmp_path))
    # set, so that the test's end restores it: just_in_time changes os.environ itself
    monkeypatch.setenv("EXTKERNELS_PREBUILT", "1")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/elsewhere")
    cache = tmp_path / "extkernels-jit"
    (cache / "old").mkdir(parents=True)
    shipping.just_in_time(cold=False)
    assert (cache / "old").exists()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(cache)
    assert os.environ["EXTKERNELS_PREBUILT"] == "0"
    shipping.just_in_time(cold=True)
    assert not (cache / "old").exists()


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@CUDA
def test_a_cuda_package_runs_from_cpp(tmp_path):
    model = _model(KnnAggregation(5, 0.1, backend="fused")).cuda()
    inputs = tuple(t.cuda() for t in INPUTS)
    with torch.no_grad():
        expected = model(*inputs)
    pt2 = shipping.package(model, inputs, tmp_path / "fused.pt2")
    both = [cpp_build.library_file(), fused_build.library_file()]
    ran = shipping.run_cpp(pt2, inputs, expected, libraries=both)
    assert ran["error"] is None and ran["max_abs_diff"] < 1e-5, ran


@pytest.mark.gpu
@CUDA
def test_cuda_graphs_replay_a_search_into_owned_buffers_and_skip_one_into_arguments():
    from extkernels.ops import fused

    q, p = (t.cuda() for t in INPUTS)
    k = 5

    class Search(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("d", torch.empty(q.shape[0], k))
            self.register_buffer("i", torch.empty(q.shape[0], k, dtype=torch.long))

        def forward(self, q, p):
            fused.knn_out(q, p, k, self.d, self.i)
            return self.i.clone()

    def into(q, p, d, i):
        fused.knn_out(q, p, k, d, i)
        return i.clone()

    d = torch.empty(q.shape[0], k, device="cuda")
    i = torch.empty(q.shape[0], k, dtype=torch.long, device="cuda")
    compile = functools.partial(torch.compile, mode="reduce-overhead", fullgraph=True)
    table = shipping.graph_table(
        {
            "buffers": functools.partial(compile(Search().cuda()), q, p),
            "arguments": functools.partial(compile(into), q, p, d, i),
        },
        n_iters=3,
    )
    assert table.at["buffers", "CUDA graph"] == "replayed"
    assert table.at["arguments", "CUDA graph"] == "skipped"
    assert torch.equal(i, extkernels.knn(q, p, k, backend="fused")[1])
