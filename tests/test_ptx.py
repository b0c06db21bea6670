"""The PTX backend (chapter 10) beyond the conformance suite: the PTX text pyptx traces
(on any machine), the operators' sums, gradients, fakes, ``opcheck`` and checks on the
CPU, the Triton gather it is timed against, and on a Hopper GPU the kernels themselves:
equal to PyTorch and to chapter 9's C++ kernels, captured in a CUDA graph, one build
per shape."""

import re
import shutil
import subprocess

import pytest
import torch
from conftest import devices
from torch._subclasses.fake_tensor import FakeTensorMode

import extkernels
from extkernels.experiments import ptx_tiers
from extkernels.graphs import CapturedStep
from extkernels.ops import ptx
from extkernels.ops.ptx import kernels
from extkernels.ops.triton import ops as triton_ops

pytestmark = pytest.mark.skipif(
    not ptx.available(), reason="pyptx or the C++ backend is not installed"
)

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
DEVICES = devices(HOPPER, reason="needs a Hopper GPU (sm_90)")
GATHER = torch.ops.extkernels_ptx.gather
SCATTER = torch.ops.extkernels_ptx.scatter


def _inputs(kind: str, m=300, k=7, n=500, f=32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = torch.softmax(torch.randn(m, k, generator=g), dim=1)
    indices = torch.randint(0, n, (m, k), generator=g)
    if kind == "one row":  # every query on the same neighbour: all atomics collide
        indices.fill_(n - 1)
    elif kind == "repeats":  # each neighbour listed k times
        indices = indices[:, :1].repeat(1, k)
    feats = torch.randn(n, f, generator=g)
    grad_out = torch.randn(m, f, generator=g)
    return [t.to(device) for t in (weights, indices, feats, grad_out)]


def _gather_ref(weights, indices, feats):
    return (weights.double().unsqueeze(-1) * feats.double()[indices]).sum(1)


def _scatter_ref(grad_out, weights, indices, n_ref):
    contributions = weights.double().unsqueeze(-1) * grad_out.double().unsqueeze(1)
    grad = torch.zeros(
        n_ref, grad_out.shape[1], dtype=torch.float64, device=grad_out.device
    )
    return grad.index_add_(0, indices.reshape(-1), contributions.flatten(0, 1))


# ------------------------------------------------------------------ the PTX text


@pytest.mark.parametrize("f, vector", [(32, True), (25, False)])
def test_ptx_targets_hopper_and_unrolls_every_neighbour(f, vector):
    text = kernels.gather.ptx(M=100, K=5, N=400, F=f)
    assert ".target sm_90a" in text
    for j in range(6):
        assert f"{kernels.neighbour_label(j)}:" in text
    loads = re.findall(r"ld\.global\.nc\.v4\.f32", text)
    assert len(loads) == (5 if vector else 0)
    assert re.search(rf"mad\.lo\.s64 %rd\d+, %rd\d+, {f * 4},", text)  # a row: F floats


@pytest.mark.parametrize(
    "f, op", [(32, "red.global.add.v4.f32"), (25, "red.global.add.f32")]
)
def test_scatter_adds_with_one_atomic_per_neighbour(f, op):
    text = kernels.scatter.ptx(M=100, K=5, N=400, F=f)
    assert len(re.findall(re.escape(op) + r" \[", text)) == 5


def test_every_shape_is_a_new_trace():
    shapes = dict(K=7, N=1000, F=32)
    a, b = kernels.gather.ptx(M=1000, **shapes), kernels.gather.ptx(M=1001, **shapes)
    assert a != b  # the number of threads to keep is a constant in the text
    assert re.search(r"setp\.ge\.u32 %p\d+, %r\d+, 8000;", a)  # 1000 queries x 8 chunks
    assert re.search(r"setp\.ge\.u32 %p\d+, %r\d+, 8008;", b)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas is not installed")
@pytest.mark.parametrize("kernel", [kernels.gather, kernels.scatter])
@pytest.mark.parametrize("f", [32, 25])
def test_ptxas_assembles_the_text(kernel, f, tmp_path):
    source = tmp_path / "k.ptx"
    source.write_text(kernel.ptx(M=300, K=7, N=500, F=f))
    result = subprocess.run(
        [
            "ptxas",
            f"-arch={kernels.ARCH}",
            str(source),
            "-o",
            str(tmp_path / "k.cubin"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------ the operators


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["random", "one row", "repeats"])
@pytest.mark.parametrize("f", [32, 25, 1])
def test_gather_and_scatter_match_float64_sums(device, kind, f):
    weights, indices, feats, grad_out = _inputs(kind, f=f, device=device)
    out = GATHER(weights, indices, feats)
    torch.testing.assert_close(out, _gather_ref(weights, indices, feats).float())
    grad = SCATTER(grad_out, weights, indices, feats.shape[0])
    want = _scatter_ref(grad_out, weights, indices, feats.shape[0])
    torch.testing.assert_close(grad.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_of_weights_and_features(device):
    weights, indices, feats, _ = _inputs("random", m=20, k=3, n=30, f=8, device=device)
    weights.requires_grad_()
    feats.requires_grad_()
    # the gather is linear in each argument: finite differences in float32 are exact up
    # to rounding
    assert torch.autograd.gradcheck(
        lambda w, x: GATHER(w, indices, x),
        (weights, feats),
        eps=1e-2,
        atol=1e-3,
        nondet_tol=1e-5,  # the scatter's atomic additions come in any order
    )


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    weights, indices, feats, grad_out = _inputs(
        "random", m=40, k=4, n=60, f=8, device=device
    )
    torch.library.opcheck(GATHER, (weights, indices, feats))
    torch.library.opcheck(
        GATHER,
        (weights.clone().requires_grad_(), indices, feats.clone().requires_grad_()),
    )
    torch.library.opcheck(SCATTER, (grad_out, weights, indices, feats.shape[0]))


@pytest.mark.parametrize("device", DEVICES)
def test_projector_compiles_with_fullgraph_and_matches_torch(device):
    p_ref = extkernels.reference_cloud(400, seed=1, device=device)
    p_query = extkernels.query_grid(5, device=device)
    feats = extkernels.features(400, 8, seed=1, device=device)

    def project(q, r, f):
        return extkernels.ops.knn_aggregate(q, r, f, 7, 0.1, backend="ptx")

    torch._dynamo.reset()
    compiled = torch.compile(project, fullgraph=True)
    want = extkernels.ops.knn_aggregate(p_query, p_ref, feats, 7, 0.1, backend="torch")
    torch.testing.assert_close(compiled(p_query, p_ref, feats), want)
    torch.testing.assert_close(project(p_query, p_ref, feats), want)


def _bad(case: str):
    weights, indices, feats, _ = _inputs("random", m=10, k=3, n=20, f=4)
    if case == "weights dtype":
        weights = weights.double()
    elif case == "indices dtype":
        indices = indices.int()
    elif case == "indices shape":
        indices = indices[:, :2].contiguous()
    elif case == "empty":
        weights, indices = weights[:0], indices[:0]
    elif case == "non-contiguous":
        feats = torch.randn(4, 20).t()
    elif case == "feats device":
        feats = feats.to("meta")
    elif case == "index out of range":
        indices[3, 1] = 20
    elif case == "negative index":
        indices[0, 0] = -1
    return weights, indices, feats


BAD = {
    "weights dtype": (TypeError, "weights: expected dtype torch.float32"),
    "indices dtype": (TypeError, "indices: expected dtype torch.int64"),
    "indices shape": (ValueError, r"indices: expected the shape of weights \(10, 3\)"),
    "empty": (ValueError, "weights: expected a non-empty"),
    "non-contiguous": (ValueError, "feats: expected a contiguous tensor"),
    "feats device": (ValueError, "feats: expected a tensor on cpu like weights"),
    "index out of range": (ValueError, r"indices: expected rows in \[0, 20\)"),
    "negative index": (
        ValueError,
        r"indices: expected rows in \[0, 20\), got values in \[-1",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_gather_rejects(case):
    error, message = BAD[case]
    with pytest.raises(error, match=message):
        GATHER(*_bad(case))


# Values are not a fake's business, nor is the layout: strides inside a compiled graph
# are the compiler's (checks.check_contiguous).
@pytest.mark.parametrize(
    "case", sorted(c for c in BAD if "index" not in c and c != "non-contiguous")
)
def test_fake_rejects_the_same_metadata(case):
    error, message = BAD[case]
    args = _bad(case)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [mode.from_tensor(t) for t in args]
        with pytest.raises(error, match=message):
            GATHER(*fakes)


def test_scatter_rejects_grad_out_and_n_ref():
    weights, indices, feats, grad_out = _inputs("random", m=10, k=3, n=20, f=4)
    with pytest.raises(ValueError, match="grad_out: expected 10 rows, got 9"):
        SCATTER(grad_out[:9], weights, indices, 20)
    with pytest.raises(ValueError, match="n_ref: expected n_ref >= 1, got 0"):
        SCATTER(grad_out, weights, indices, 0)
    with pytest.raises(ValueError, match=r"indices: expected rows in \[0, 5\)"):
        SCATTER(grad_out, weights, indices, 5)


def test_triton_gather_matches_float64_sums():
    weights, indices, feats, _ = _inputs("random", m=70, k=7, n=90, f=37)
    out = triton_ops.gather(weights, indices, feats)
    torch.testing.assert_close(out, _gather_ref(weights, indices, feats).float())


def test_buckets_bound_the_builds():
    sizes = [1000, 1500, 1700, 3000, 1024, 5000, 4100]
    table = ptx_tiers.bucket_builds(sizes)
    assert list(table["padded to"]) == [1024, 2048, 2048, 4096, 1024, 8192, 8192]
    assert table["builds, one per shape"].iloc[-1] == len(set(sizes))
    assert table["builds, one per bucket"].iloc[-1] == 4


# ------------------------------------------------------------- on a Hopper GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("f", [32, 25])
def test_cuda_kernels_match_the_cpp_kernels(f):
    weights, indices, feats, grad_out = _inputs(
        "random", m=3000, n=5000, f=f, device="cuda"
    )
    cpp = torch.ops.extkernels_cpp
    torch.testing.assert_close(
        GATHER(weights, indices, feats), cpp.gather(weights, indices, feats, False)
    )
    torch.testing.assert_close(
        SCATTER(grad_out, weights, indices, 5000),
        cpp.knn_aggregate_bwd(grad_out, weights, indices, 5000),
    )


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")
def test_cuda_graph_replays_the_gather_and_scatter():
    weights, indices, feats, grad_out = _inputs("random", device="cuda")
    out = GATHER(weights, indices, feats)
    grad = SCATTER(grad_out, weights, indices, feats.shape[0])
    step = CapturedStep(
        lambda: (
            GATHER(weights, indices, feats),
            SCATTER(grad_out, weights, indices, 500),
        )
    )
    feats.mul_(2.0)
    grad_out.mul_(2.0)
    out_g, grad_g = step()
    torch.cuda.synchronize()
    # the replay read the new values where the capture found the old ones
    torch.testing.assert_close(out_g, 2 * out)
    torch.testing.assert_close(grad_g, 2 * grad)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")
def test_one_build_per_shape():
    feats = torch.randn(500, 32, device="cuda")
    before = len(ptx_tiers.builds(kernels.gather))
    table = ptx_tiers.build_costs(feats, 7, [1111, 1112, 1111 + 1])
    assert list(table["builds held"]) == [before + 1, before + 2, before + 2]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")
def test_pyptx_operator_is_the_build_for_the_shapes_asked():
    feats = torch.randn(300, 16, device="cuda")
    found = {}
    for m in (333, 334):  # two builds of the same kernel; the first must be found
        weights = torch.rand(m, 5, device="cuda")
        indices = torch.randint(0, 300, (m, 5), device="cuda")
        expected = kernels.gather(weights, indices, feats)
        found[m] = (weights, indices, expected)
    weights, indices, expected = found[333]
    shapes = ptx_tiers.gather_shapes(weights, feats)
    op = ptx_tiers.pyptx_operator(kernels.gather, **shapes)
    (got,) = op([weights, indices, feats])
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# ------------------------------------------------------- chapter 10's helpers


def _against_references(weights, indices, feats, feats32, grad_out) -> dict[str, bool]:
    """The PTX gather against a float64 sum and against chapter 9's C++ gather
    with ``feats`` ``(N, F)`` and ``feats32`` ``(N, 32)`` (float4 loads there), and the
    PTX scatter of ``grad_out`` ``(M, F)`` against a float64 ``index_add_``. Weights
    ``(M, k)`` float32, indices ``(M, k)`` int64."""
    gather, scatter = torch.ops.extkernels_ptx.gather, torch.ops.extkernels_ptx.scatter
    cpp_gather = torch.ops.extkernels_cpp.gather
    n_ref = feats.shape[0]
    exact = (weights.double().unsqueeze(-1) * feats.double()[indices]).sum(1)
    contributions = weights.double().unsqueeze(-1) * grad_out.double().unsqueeze(1)
    scattered = torch.zeros(
        n_ref, grad_out.shape[1], dtype=torch.float64, device=feats.device
    )
    scattered.index_add_(0, indices.reshape(-1), contributions.flatten(0, 1))
    return {
        "gather equals the float64 sum": torch.allclose(
            gather(weights, indices, feats).double(), exact, atol=1e-5
        ),
        f"gather equals chapter 9's C++ gather ({feats.shape[1]} features)": (
            torch.allclose(
                gather(weights, indices, feats),
                cpp_gather(weights, indices, feats, False),
                atol=1e-6,
            )
        ),
        "gather equals chapter 9's C++ gather (32 features)": torch.allclose(
            gather(weights, indices, feats32),
            cpp_gather(weights, indices, feats32, True),
            atol=1e-6,
        ),
        "scatter equals the float64 index_add_": torch.allclose(
            scatter(grad_out, weights, indices, n_ref).double(), scattered, atol=1e-4
        ),
    }


def test_references_pass_and_catch_a_wrong_gather(monkeypatch):
    weights, indices, feats, grad_out = _inputs("random", m=60, k=5, n=80, f=25)
    feats32 = torch.randn(80, 32, generator=torch.Generator().manual_seed(3))
    args = (weights, indices, feats, feats32, grad_out)
    checks = _against_references(*args)
    assert list(checks)[1] == "gather equals chapter 9's C++ gather (25 features)"
    assert all(checks.values()), checks
    # A gather off by 1e-3 fails every comparison of the gather, not the scatter's.
    monkeypatch.setattr(
        torch.ops.extkernels_ptx, "gather", lambda w, i, f: GATHER(w, i, f) + 1e-3
    )
    wrong = _against_references(*args)
    assert [wrong[name] for name in checks] == [False, False, False, True]


def test_glue_of_the_call_costs_reads_the_kernels_own_row():
    import pandas as pd

    rows = [
        "pyptx kernel object (its C++ bridge)",
        "the kernel alone (do_bench: device time, L2 emptied first)",
    ]
    costs = pd.DataFrame({"µs per call": [30.0, 5.0]}, index=rows)
    assert ptx_tiers.call_costs_glue(costs) == {"gather_device_us": 5.0}


def test_rows_read_as_vectors_are_moved_to_an_aligned_address():
    from extkernels.ops.ptx.ops import vector_aligned

    buf = torch.arange(4 * 8 + 1, dtype=torch.float32)
    view = buf[1:].view(4, 8)  # contiguous, 4 bytes past an aligned block
    assert view.is_contiguous() and view.data_ptr() % 16 == 4
    moved = vector_aligned(view)
    assert moved.data_ptr() % 16 == 0 and torch.equal(moved, view)
    aligned = buf[:32].view(4, 8)
    assert vector_aligned(aligned) is aligned  # nothing to move
    odd = torch.arange(3 * 3 + 1, dtype=torch.float32)[1:].view(3, 3)
    assert vector_aligned(odd) is odd  # F = 3: read one float at a time
