"""The C++ backend (chapter 9) beyond the conformance suite: the kernels built just in
time, exact against SciPy's k-d tree on random and awkward clouds at sizes that need
many rings, every feature dtype, the float4 gather, the value-check switch, capture in a
CUDA graph. Its CUDA source is compiled by ``nvcc`` where it is installed, so that a
syntax error in it never waits for a GPU: in test_fused_batched.py, with the fused
library's sources, as one translation unit."""

import math
import os

import pytest
import torch
from conftest import DEVICES

cKDTree = pytest.importorskip("scipy.spatial").cKDTree

from extkernels.ops import checks, cpp  # noqa: E402
from extkernels.ops.cpp import build  # noqa: E402

pytestmark = pytest.mark.skipif(
    not cpp.available(), reason="no C++ compiler or ninja on this machine"
)


@pytest.fixture(scope="module")
def ops():
    cpp.prepare()
    from extkernels.ops.cpp import ops

    return torch.ops.extkernels_cpp, ops


def _clouds(kind: str, m: int = 300, n: int = 2000, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r, q = torch.randn(n, 3, generator=g), torch.randn(m, 3, generator=g)
    if kind == "far":
        q = q * 50.0  # most queries far outside the cloud's box
    elif kind == "flat":
        r[:, 2] = 0.5
        q[:, 2] = 0.5 + 0.1 * q[:, 2]
    elif kind == "duplicates":
        r = r[: n // 20].repeat(20, 1)
    elif kind == "clusters":
        centres = torch.randn(3, 3, generator=g).repeat_interleave(n // 3 + 1, 0)[:n]
        r = centres + 1e-4 * torch.randn(n, 3, generator=g)
    elif kind == "offset":
        r, q = r + 1000.0, q + 1000.0
    return q.contiguous(), r.contiguous()


KINDS = ["random", "far", "flat", "duplicates", "clusters", "offset"]


def _reference(q, r, k):
    d, i = cKDTree(r.double().numpy()).query(q.double().numpy(), k)
    return (
        torch.from_numpy(d).float().reshape(len(q), k),
        torch.from_numpy(i).reshape(len(q), k),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 7, 40])
def test_knn_is_exact(ops, device, kind, k):
    q, r = _clouds(kind)
    d, i = ops[0].knn(q.to(device), r.to(device), k)
    d, i = d.cpu(), i.cpu()
    want, _ = _reference(q, r, k)
    torch.testing.assert_close(d, want, atol=1e-4, rtol=1e-5)
    # Every index lies at its distance (ties may pick either point), none twice.
    at = (q[:, None, :] - r[i]).norm(dim=-1)
    torch.testing.assert_close(at, d, atol=1e-4, rtol=1e-5)
    assert all(len(set(row)) == k for row in i.tolist())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype, tol",
    [(torch.float32, 1e-5), (torch.float64, 1e-5), (torch.float16, 2e-3)],
)
def test_aggregation_and_gradient_in_every_feature_dtype(ops, device, dtype, tol):
    q, r = _clouds("random", 200, 1500)
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(1500, 12, generator=g)
    grad_out = torch.randn(200, 12, generator=g)
    d, i = _reference(q, r, 7)
    w = torch.softmax(-d.double() / 0.1, dim=1)
    want = (w[:, :, None] * feats.double()[i]).sum(1)
    want_grad = torch.zeros(1500, 12, dtype=torch.float64).index_add_(
        0, i.reshape(-1), (w[:, :, None] * grad_out.double()[:, None]).reshape(-1, 12)
    )
    leaf = feats.to(device, dtype).requires_grad_(True)
    out = ops[1].knn_aggregate(q.to(device), r.to(device), leaf, 7, 0.1)
    out.backward(grad_out.to(device, dtype))
    assert out.dtype == leaf.grad.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(leaf.grad.cpu().double(), want_grad, atol=tol, rtol=tol)


def test_gradcheck_in_float64_on_the_cpu_kernel(ops):
    q, r = _clouds("clusters", 40, 300)
    feats = torch.randn(300, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x: ops[0].knn_aggregate_fwd(q, r, x, 5, 0.1)[0], (feats,)
    )


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_of_every_operator(ops, device):
    q, r = (t.to(device) for t in _clouds("random", 60, 400))
    feats = torch.randn(400, 8, device=device)
    w, i = ops[0].knn_aggregate_fwd(q, r, feats, 5, 0.1)[1:]
    opcheck = torch.library.opcheck
    opcheck(ops[0].knn.default, (q, r, 5))
    opcheck(ops[0].knn_aggregate_fwd.default, (q, r, feats.half(), 5, 0.1))
    opcheck(ops[0].knn_aggregate_fwd.default, (q, r, feats.requires_grad_(), 5, 0.1))
    grad_out = torch.randn(60, 8, device=device)
    opcheck(ops[0].knn_aggregate_bwd.default, (grad_out, w, i, 400))
    opcheck(ops[0].gather.default, (w, i, feats.detach(), True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("f", [4, 32])
def test_float4_gather_matches_the_scalar_one(ops, device, f):
    q, r = (t.to(device) for t in _clouds("random", 300, 2000))
    feats = torch.randn(2000, f, device=device)
    _, w, i = ops[0].knn_aggregate_fwd(q, r, feats, 7, 0.1)
    scalar = ops[1].gather(w, i, feats, vector_loads=False)
    vector = ops[1].gather(w, i, feats, vector_loads=True)
    torch.testing.assert_close(vector, scalar, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="^vector_loads: float4 loads need"):
        ops[1].gather(w, i, torch.randn(2000, f + 1, device=device), vector_loads=True)


@pytest.mark.parametrize("device", DEVICES)
def test_a_misaligned_view_is_refused_by_the_float4_gather(ops, device):
    q, r = (t.to(device) for t in _clouds("random", 50, 400))
    _, w, i = ops[0].knn_aggregate_fwd(q, r, torch.randn(400, 8, device=device), 7, 0.1)
    storage = torch.randn(400 * 8 + 1, device=device)
    view = storage[1:].view(400, 8)  # contiguous, but 4 bytes past a 16-byte boundary
    assert view.is_contiguous() and view.data_ptr() % 16 == 4
    with pytest.raises(
        ValueError, match="^feats: float4 loads need features that start"
    ):
        ops[1].gather(w, i, view, vector_loads=True)
    torch.testing.assert_close(
        ops[1].gather(w, i, view, vector_loads=False),
        ops[1].gather(w, i, view.clone(), vector_loads=True),
        atol=1e-6,
        rtol=1e-6,
    )


def test_another_threads_switch_leaves_this_threads_checks_on(ops):
    import threading

    q, r = _clouds("random", 20, 100)
    bad = q.clone()
    bad[3, 1] = math.nan
    switched, done = threading.Event(), threading.Event()

    def other_thread():
        previous = torch.ops.extkernels_cpp.set_value_checks(False)
        switched.set()
        done.wait(timeout=60)
        torch.ops.extkernels_cpp.set_value_checks(previous)

    worker = threading.Thread(target=other_thread)
    worker.start()
    try:
        assert switched.wait(timeout=60)
        with pytest.raises(ValueError, match="^p_query: expected finite coordinates"):
            torch.ops.extkernels_cpp.knn(bad, r, 3)
    finally:
        done.set()
        worker.join()


def test_the_kernels_limits_come_from_the_library(ops):
    from extkernels.ops import fused
    from extkernels.ops.cpp import ops as cpp_ops

    fused.prepare()
    assert [cpp_ops.max_k(), cpp_ops.max_points()] == list(
        torch.ops.extkernels_cpp.limits()
    )
    assert cpp_ops.max_points() == 2**28 - 1
    # 3 GiB of address space that nothing touches: the sizes are refused before the
    # values are read, so no page of it is ever backed by memory
    q, r = torch.zeros(10, 3), torch.empty(cpp_ops.max_points() + 1, 3)
    for op in (ops[0].knn, torch.ops.extkernels_fused.knn):
        with pytest.raises(ValueError, match="^p_ref: expected at most 268435455"):
            op(q, r, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_deterministic_mode_gives_one_answer_or_refuses(ops):
    from extkernels.ops import fused

    fused.prepare()
    q, r = (t.cuda() for t in _clouds("random", 500, 3000))
    r[:1500] = r[1500:]  # every point twice: ties everywhere
    torch.use_deterministic_algorithms(True)
    try:
        for op, extra in (
            (ops[0].knn, ()),
            (torch.ops.extkernels_fused.knn, (4, "grid")),
            (torch.ops.extkernels_fused.knn, (4, "tree")),
        ):
            first = op(q, r, 7, *extra)[1]
            for _ in range(5):
                assert torch.equal(op(q, r, 7, *extra)[1], first)
        feats = torch.randn(3000, 5, device="cuda")
        _, w, i = ops[0].knn_aggregate_fwd(q, r, feats, 7, 0.1)
        with pytest.raises(RuntimeError, match="knn_aggregate_bwd"):
            torch.ops.extkernels_cpp.knn_aggregate_bwd(
                torch.ones(500, 5, device="cuda"), w, i, 3000
            )
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("device", DEVICES)
def test_the_value_check_switch_reaches_the_kernels(ops, device):
    q, r = (t.to(device) for t in _clouds("random", 20, 100))
    bad = q.clone()
    bad[3, 1] = math.nan
    with pytest.raises(ValueError, match="^p_query: expected finite coordinates"):
        ops[0].knn(bad, r, 3)
    with checks.value_checks(False):
        d, _ = ops[0].knn(bad, r, 3)  # the reader switched them off: no error
    assert not torch.isfinite(d[3]).all() and torch.isfinite(d[4]).all()
    with pytest.raises(ValueError, match="^p_ref: expected finite coordinates"):
        ops[0].knn(q, torch.where(r > 1.5, math.inf, r), 3)


def test_k_beyond_the_kernels_list_is_refused_by_kernel_and_fake(ops):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, r = _clouds("random", 10, 100)
    with pytest.raises(ValueError, match="^k: expected k <= 64"):
        ops[0].knn(q, r, 65)
    with FakeTensorMode() as mode:
        fq, fr = mode.from_tensor(q), mode.from_tensor(r)
        with pytest.raises(ValueError, match="^k: expected k <= 64"):
            ops[0].knn(fq, fr, 65)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_forward_and_backward_replay_in_one_cuda_graph(ops):
    q, r = (t.cuda() for t in _clouds("random", 500, 5000))
    feats = torch.randn(5000, 8, device="cuda", requires_grad=True)
    grad_out = torch.randn(500, 8, device="cuda")

    def step():
        out = ops[1].knn_aggregate(q, r, feats, 7, 0.1)
        return out, torch.autograd.grad(out, feats, grad_out)[0]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        before = [t.detach().clone() for t in step()]  # warm-up on a side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # detached: the autograd graph of the capture stream's run is not kept alive
        # into the eager step below (its leaf's AccumulateGrad would be on that stream)
        captured = [t.detach() for t in step()]
    r.add_(0.05 * torch.randn_like(r))  # moved points: the replay builds a new grid
    graph.replay()
    want = step()
    assert not torch.allclose(want[0], before[0])
    for got, expected in zip(captured, want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_stable_coverage_lists_the_aten_calls_of_the_sources():
    table = build.stable_coverage()
    sources = "".join(p.read_text() for p in build.CSRC.iterdir())
    # every listed call is in the sources, as often as counted
    for name, row in table.iterrows():
        assert sources.count(f"at::{name}(") == row["calls"], name
    assert {"cumsum", "aminmax", "empty"} <= set(table.index)
    # torch::stable has empty() since 2.9, and no cumsum in the PyTorch this book pins
    assert table.loc["empty", "in torch::stable"]
    assert not table.loc["cumsum", "in torch::stable"]


def test_stable_coverage_reads_the_folders_it_is_given(tmp_path):
    (tmp_path / "a.cpp").write_text("at::empty({1}); at::empty({2}); at::cumsum(x, 0);")
    table = build.stable_coverage([tmp_path])
    assert table["calls"].to_dict() == {"empty": 2, "cumsum": 1}
    both = build.stable_coverage([tmp_path, build.CSRC])
    alone = build.stable_coverage().loc["empty", "calls"]
    assert both.loc["empty", "calls"] == 2 + alone


# ------------------------------------------ the Python half and chapter 9's helpers


def test_the_fake_gives_the_kernels_shapes_and_refuses_what_they_refuse(ops):
    q, r = _clouds("random", 30, 200)
    feats = torch.randn(200, 6, dtype=torch.float64)
    out, w, i = ops[1].knn_aggregate_fwd_fake(q, r, feats, 5, 0.1)
    real = ops[0].knn_aggregate_fwd(q, r, feats, 5, 0.1)
    assert [(t.shape, t.dtype) for t in (out, w, i)] == [
        (t.shape, t.dtype) for t in real
    ]
    with pytest.raises(ValueError, match="^k: expected k <= 64"):
        ops[1].knn_aggregate_fwd_fake(q, r, feats, 65, 0.1)


@pytest.mark.parametrize("extra", [(), (4, "grid"), (4, "tree")])
def test_one_autograd_formula_serves_the_cpp_and_the_fused_operator(ops, extra):
    """``register_knn_autograd`` on both operators: the fused one, called with its
    options left to their defaults or given, has chapter 9's gradient."""
    from extkernels.ops import fused

    fused.prepare()
    q, r = _clouds("random", 80, 600)
    feats = torch.randn(600, 5, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(80, 5, dtype=torch.float64)
    want = torch.autograd.grad(
        ops[0].knn_aggregate_fwd(q, r, feats, 7, 0.1)[0], feats, grad_out
    )[0]
    fused_fwd = torch.ops.extkernels_fused.knn_aggregate_fwd
    out = fused_fwd(q, r, feats, 7, 0.1, *extra)[0]
    got = torch.autograd.grad(out, feats, grad_out)[0]
    # the tree's float32 weights are summed in another order than the grid's
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    small = feats[:300].detach().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda f: fused_fwd(q[:20], r[:300], f, 5, 0.1, *extra)[0], (small,)
    )


def test_the_build_summary_names_what_was_built(ops):
    table = build.summary()
    assert list(table.index) == [
        "sources",
        "TORCH_CUDA_ARCH_LIST",
        "seconds to build or load",
    ]
    assert table.loc["sources", "extension"].startswith("knn.cpp")
    assert table.loc["seconds to build or load", "extension"] >= 0
    if build.arch_list() is None:
        assert table.loc["TORCH_CUDA_ARCH_LIST", "extension"] == "(CPU only)"
        assert table.loc["sources", "extension"] == "knn.cpp"


def test_the_architectures_are_read_without_writing_the_environment(monkeypatch):
    monkeypatch.setattr(build, "_with_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert build.arch_list() == "9.0"  # this GPU's
    assert "TORCH_CUDA_ARCH_LIST" not in os.environ  # a getter leaves it alone
    with build.arch_environment() as arch:  # a build sets it, for the build only
        assert arch == os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert "TORCH_CUDA_ARCH_LIST" not in os.environ
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")  # the reader's choice wins
    with build.arch_environment() as arch:
        assert arch == "8.0;9.0"
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0"


def _table(ms: dict[str, tuple[float, float]], spread: float = 0.01):
    """A benchmark table (timing.timings_frame's columns) with forward and training
    medians ``ms[variant]`` and runs ``spread`` ms either side."""
    import pandas as pd

    rows = {
        name: {
            "forward_ms": f,
            "train_ms": t,
            "forward_min": f - spread,
            "forward_max": f + spread,
            "train_min": t - spread,
            "train_max": t + spread,
        }
        for name, (f, t) in ms.items()
    }
    return pd.DataFrame(rows).T


def test_chapter_9s_quotes_read_the_right_rows():
    from extkernels.experiments import cuda_knn

    table = _table(
        {
            "knn/cpp": (0.5, 2.5),
            "knn/cpp+compile": (0.3, 2.5),
            "knn/cpp+graphs": (0.26, 0.56),
            "knn/cpp+reduce-overhead": (0.31, 1.5),
            "knn/triton+reduce-overhead": (0.35, 1.6),
            "knn/floor": (0.28, 1.7),
            "knn/floor+graphs": (0.07, 0.36),
        }
    )
    assert cuda_knn.timing_quotes(table) == {
        "graphs_train_ms": 0.56,
        "ro_train_ms": 1.5,
    }


def test_chapter_9s_vector_load_quote_is_the_gathers_ratio():
    import pandas as pd

    from extkernels.experiments import cuda_knn

    loads = pd.DataFrame(
        {"ms (do_bench)": [0.02, 0.01]},
        index=[
            "gather, 32 features, scalar loads",
            "gather, 32 features, float4 loads",
        ],
    )
    assert cuda_knn.vector_load_quotes(loads) == {"float4_gain": 2.0}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_vector_loads_times_both_gathers_and_both_dtypes(ops):
    pytest.importorskip("triton")
    from extkernels.experiments import cuda_knn

    q, r = (t.cuda() for t in _clouds("random", 500, 4000))
    loads = cuda_knn.vector_loads(q, r, torch.randn(4000, 25, device="cuda"), 7, 0.1)
    assert len(loads) == 4 and (loads["ms (do_bench)"] > 0).all()
    assert cuda_knn.vector_load_quotes(loads)["float4_gain"] > 0
