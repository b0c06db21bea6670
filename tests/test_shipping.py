"""Export and AOTInductor packages of the projector on the CPU: the C++ operators
export as themselves and survive decomposition; a package runs in a fresh process that
loads only the operator libraries, fails there with PyTorch's error without them, and
a Python-defined operator runs there only where its Python is imported."""

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
    ran = shipping.run_fresh(pt2, INPUTS, expected, libraries=libraries, seconds=0.1)
    assert ran["error"] is None and ran["max_abs_diff"] < 1e-5 and ran["ms"] > 0
    bare = shipping.run_fresh(pt2, INPUTS, expected, seconds=0.1)
    assert "Could not find schema for extkernels_" in bare["error"]


def test_a_python_operator_in_a_package_needs_its_python(tmp_path):
    aggregation = RadiusAggregation(0.3, 0.1, backend="warp")
    pt2, expected = _packaged(aggregation, tmp_path / "warp.pt2")
    bare = shipping.run_fresh(pt2, INPUTS, expected, seconds=0.1)
    assert "cannot be run via AOTI without Python" in bare["error"]
    ran = shipping.run_fresh(
        pt2, INPUTS, expected, imports=["extkernels.ops.warp"], seconds=0.1
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
