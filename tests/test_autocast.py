"""The aggregations under ``torch.autocast``: features of a lower precision are cast to
float32 and every backend runs with autocast off, so the neighbours and weights are the
float32 ones; the gradient reaches the lower-precision features."""

import pytest
import torch
from conftest import DEVICES

import extkernels
from extkernels.models import KnnAggregation, Projector, RadiusAggregation
from extkernels.ops import registry

ARGS = {"knn_aggregate": (5, 0.1), "radius_aggregate": (0.3, 0.1)}
LOW = {"cpu": torch.bfloat16, "cuda": torch.float16}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "op, backend", [(op, name) for op in ARGS for name in extkernels.backends(op)]
)
def test_an_aggregation_under_autocast_is_its_float32_result(op, backend, device):
    if not registry.get(backend).runs_on(device):
        pytest.skip(f"{backend} does not run on {device} here")
    p_ref = extkernels.reference_cloud(300, seed=0).to(device)
    p_query = extkernels.query_grid(5).to(device)
    low = extkernels.features(300, 4, seed=0).to(device, LOW[device.split(":")[0]])
    feats = low.clone().requires_grad_(True)
    fn = getattr(extkernels, op)
    with torch.autocast(device.split(":")[0], LOW[device.split(":")[0]]):
        out = fn(p_query, p_ref, feats, *ARGS[op], backend=backend)
    assert out.dtype == torch.float32
    expected = fn(p_query, p_ref, low.float(), *ARGS[op], backend=backend)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.square().sum().backward()
    assert feats.grad is not None and feats.grad.dtype == feats.dtype


@pytest.mark.parametrize(
    "aggregation",
    [KnnAggregation(5, 0.1, backend="torch"), RadiusAggregation(0.3, 0.1)],
    ids=["knn", "radius"],
)
def test_the_projector_compiles_whole_under_autocast(aggregation):
    torch.manual_seed(0)
    model = Projector(aggregation, hidden=16)
    p_ref = extkernels.reference_cloud(300, seed=0)
    p_query = extkernels.query_grid(5)
    compiled = torch.compile(model, fullgraph=True)
    with torch.autocast("cpu", torch.bfloat16):
        eager = model(p_query, p_ref)
        got = compiled(p_query, p_ref)
    torch.testing.assert_close(got, eager, rtol=2e-2, atol=2e-2)
