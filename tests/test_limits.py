"""The sizes a backend's kernels index with 32-bit integers: past its limit (defined
once, beside its kernels), the custom operator, its fake and the entry point refuse
them with a ``ValueError`` that names the argument; at the limit they go through.

Fake tensors stand for the clouds, so that no 2^31-element tensor is ever allocated;
fakes on ``cuda`` work without a GPU, so the CUDA operators' fakes are tested here too.
Where a real call needs no large tensor (the limit passed by a product of two modest
sizes), the real implementations on the CPU are tested as well.
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._subclasses.fake_tensor import FakeTensorMode

import extkernels
from extkernels.ops import checks, cpp, fused, ptx
from extkernels.ops import triton as triton_backend

HAVE_TRITON = triton_backend.available()
HAVE_CPP = cpp.available()
HAVE_PTX = ptx.available()

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed")
needs_cpp = pytest.mark.skipif(not HAVE_CPP, reason="no C++ compiler or ninja")
needs_ptx = pytest.mark.skipif(not HAVE_PTX, reason="pyptx is not installed")

DEVICES = ["cpu", "cuda"]  # of the fakes: no GPU needed


def _t(*shape, device, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device=device)


def _clouds(device, m: int = 10, n: int = 64, f: int | None = None) -> tuple:
    """``m`` queries and ``n`` points, and with ``f`` an ``(n, f)`` feature matrix."""
    clouds = (_t(m, 3, device=device), _t(n, 3, device=device))
    return clouds if f is None else (*clouds, _t(n, f, device=device))


# ------------------------------------------------------------------ the helper


def test_the_helper_names_the_argument_and_both_sizes():
    checks.check_index_limit("p_query", "queries", 10, 10, "why")  # at the limit
    with pytest.raises(ValueError) as info:
        checks.check_index_limit("p_query", "queries × features", 11, 10, "why")
    assert str(info.value) == (
        "p_query: expected at most 10 queries × features (why), got 11"
    )


# ------------------------------------------------------- the backends' limits


@needs_triton
def test_triton_limit_is_the_int32_range():
    from extkernels.ops.triton import kernels

    assert kernels.MAX_INDEX == 2**31 - 1


@needs_ptx
def test_ptx_limit_is_the_u32_range():
    from extkernels.ops.ptx import kernels

    assert kernels.MAX_THREADS == 2**32 - 1


@needs_cpp
def test_fused_limits_fit_32_bit_rows():
    fused.prepare()
    from extkernels.ops.fused import ops

    assert ops.max_queries() == torch.iinfo(torch.int32).max
    assert ops.max_radius_queries() == 2**30


# ---------------------------------------------------------------- the cases
# Each builds, on a device, the call of an operator with sizes just past its limit
# (over=True) or at or just under it (over=False), and names the argument refused.


def _triton():
    from extkernels.ops.triton import kernels

    return torch.ops.triton_knn, kernels.MAX_INDEX


def _cpp_limits():
    cpp.prepare()
    fused.prepare()
    from extkernels.ops.cpp import ops as cpp_ops
    from extkernels.ops.fused import ops as fused_ops

    return cpp_ops.max_points(), fused_ops.max_queries(), fused_ops.max_radius_queries()


def _ptx():
    from extkernels.ops.ptx import kernels

    return torch.ops.extkernels_ptx, kernels.MAX_THREADS


def triton_knn_queries(device, over):
    ops, limit = _triton()
    q, r = _clouds(device, m=limit // 3 + over, n=64)
    return lambda: ops.knn(q, r, 4), "p_query"


def triton_knn_points(device, over):
    ops, limit = _triton()
    q, r = _clouds(device, m=10, n=limit // 3 + over)
    return lambda: ops.knn(q, r, 4), "p_ref"


def triton_aggregate_features(device, over):
    # 2^26 queries x 32 features = 2^31: the backward's row x F offsets would wrap
    ops, _ = _triton()
    q, r, f = _clouds(device, m=2**26, n=64, f=32 if over else 31)
    return lambda: ops.knn_aggregate_fwd(q, r, f, 4, 0.1), "p_query"


def triton_aggregate_neighbours(device, over):
    ops, _ = _triton()
    q, r, f = _clouds(device, m=2**26, n=64, f=1)
    k = 32 if over else 31
    return lambda: ops.knn_aggregate_fwd(q, r, f, k, 0.1), "p_query"


def triton_backward_features(device, over):
    ops, _ = _triton()
    g = _t(2**26, 32 if over else 31, device=device)
    w = _t(2**26, 4, device=device)
    i = _t(2**26, 4, device=device, dtype=torch.int64)
    return lambda: ops.knn_aggregate_bwd(g, w, i, 64), "grad_out"


def triton_backward_neighbours(device, over):
    ops, _ = _triton()
    k = 32 if over else 31
    g = _t(2**26, 1, device=device)
    w = _t(2**26, k, device=device)
    i = _t(2**26, k, device=device, dtype=torch.int64)
    return lambda: ops.knn_aggregate_bwd(g, w, i, 64), "weights"


def _library_case(qualname: str, refused: str, limit: str, *args):
    """A case of a C++ library's operator ``qualname``: its clouds sized by ``limit``
    (``points``, ``queries`` or ``radius queries``) in the argument ``refused``, with
    features where it aggregates, then ``args``."""

    def case(device, over):
        sizes = ("points", "queries", "radius queries")
        limits = dict(zip(sizes, _cpp_limits(), strict=True))
        size = limits[limit] + over
        m, n = (size, 64) if refused == "p_query" else (10, size)
        f = 2 if "aggregate" in qualname else None
        clouds = _clouds(device, m=m, n=n, f=f)
        namespace, name = qualname.split("::")
        op = getattr(getattr(torch.ops, namespace), name)
        return lambda: op(*clouds, *args), refused

    return case


LIBRARY_CASES = {
    "cpp_knn_points": ("extkernels_cpp::knn", "p_ref", "points", 4),
    "cpp_aggregate_points": (
        "extkernels_cpp::knn_aggregate_fwd", "p_ref", "points", 4, 0.1,
    ),
    "fused_knn_queries": ("extkernels_fused::knn", "p_query", "queries", 4),
    "fused_knn_points": ("extkernels_fused::knn", "p_ref", "points", 4),
    "fused_knn_work_points": ("extkernels_fused::knn_work", "p_ref", "points", 4),
    "fused_aggregate_queries": (
        "extkernels_fused::knn_aggregate_fwd", "p_query", "queries", 4, 0.1,
    ),
    "fused_radius_queries": (
        "extkernels_fused::radius_aggregate_fwd", "p_query", "radius queries", 0.1, 0.1,
    ),
    "fused_radius_points": (
        "extkernels_fused::radius_aggregate_fwd", "p_ref", "points", 0.1, 0.1,
    ),
}  # fmt: skip


def _neighbours(m, device):
    return _t(m, 4, device=device), _t(m, 4, device=device, dtype=torch.int64)


def ptx_gather_scalars(device, over):
    # F odd: a thread per query and feature, 2^16 x (2^16 + 1) > 2^32 - 1 of them
    ops, _ = _ptx()
    w, i = _neighbours(2**16, device)
    f = _t(64, 2**16 + 1 if over else 2**16 - 1, device=device)
    return lambda: ops.gather(w, i, f), "feats"


def ptx_gather_vectors(device, over):
    # F a multiple of 4: a thread per query and 4 features, 2^16 x 2^16 = 2^32
    ops, _ = _ptx()
    w, i = _neighbours(2**16, device)
    f = _t(64, 2**18 if over else 2**18 - 4, device=device)
    return lambda: ops.gather(w, i, f), "feats"


def ptx_scatter(device, over):
    ops, _ = _ptx()
    w, i = _neighbours(2**16, device)
    g = _t(2**16, 2**16 + 1 if over else 2**16 - 1, device=device)
    return lambda: ops.scatter(g, w, i, 64), "grad_out"


OPERATOR_CASES = [
    pytest.param(triton_knn_queries, marks=needs_triton),
    pytest.param(triton_knn_points, marks=needs_triton),
    pytest.param(triton_aggregate_features, marks=needs_triton),
    pytest.param(triton_aggregate_neighbours, marks=needs_triton),
    pytest.param(triton_backward_features, marks=needs_triton),
    pytest.param(triton_backward_neighbours, marks=needs_triton),
    *(
        pytest.param(_library_case(*spec), marks=needs_cpp, id=name)
        for name, spec in LIBRARY_CASES.items()
    ),
    pytest.param(ptx_gather_scalars, marks=needs_ptx),
    pytest.param(ptx_gather_vectors, marks=needs_ptx),
    pytest.param(ptx_scatter, marks=needs_ptx),
]

# Triton operators without a fake of their own run their Python body on fakes, launch
# included: on CUDA fakes that needs a GPU (the refusal comes first, so it does not).
TRACES_THE_LAUNCH = {
    triton_aggregate_features,
    triton_aggregate_neighbours,
    triton_backward_features,
    triton_backward_neighbours,
}


# ---------------------------------------------------------------- entry points


def _entry(device, op: str, backend: str, m: int, n: int = 64, f: int = 2):
    """``extkernels.<op>`` with ``backend`` on fake clouds of ``m`` queries and ``n``
    points (and ``f`` features for the aggregations), to call under FakeTensorMode."""
    clouds = _clouds(device, m, n, None if op == "knn" else f)
    args = {"knn": (4,), "knn_aggregate": (4, 0.1), "radius_aggregate": (0.1, 0.1)}[op]
    return lambda: getattr(extkernels, op)(*clouds, *args, backend=backend)


def entry_triton_knn(device, over):
    _, limit = _triton()
    return _entry(device, "knn", "triton", limit // 3 + over), "p_query"


def entry_triton_aggregate(device, over):
    f = 32 if over else 31
    return _entry(device, "knn_aggregate", "triton", 2**26, f=f), "p_query"


def entry_cpp_knn(device, over):
    max_points, _, _ = _cpp_limits()
    return _entry(device, "knn", "cpp", 10, n=max_points + over), "p_ref"


def entry_fused_knn(device, over):
    _, max_queries, _ = _cpp_limits()
    return _entry(device, "knn", "fused", max_queries + over), "p_query"


def entry_fused_aggregate(device, over):
    _, max_queries, _ = _cpp_limits()
    return _entry(device, "knn_aggregate", "fused", max_queries + over), "p_query"


def entry_fused_radius(device, over):
    _, _, max_radius = _cpp_limits()
    return _entry(device, "radius_aggregate", "fused", max_radius + over), "p_query"


def entry_ptx_aggregate(device, over):
    _ptx()
    f = 2**16 + 1 if over else 2**16 - 1
    return _entry(device, "knn_aggregate", "ptx", 2**16, f=f), "feats"


ENTRY_CASES = [
    pytest.param(entry_triton_knn, marks=needs_triton),
    pytest.param(entry_triton_aggregate, marks=needs_triton),
    pytest.param(entry_cpp_knn, marks=needs_cpp),
    pytest.param(entry_fused_knn, marks=needs_cpp),
    pytest.param(entry_fused_aggregate, marks=needs_cpp),
    pytest.param(entry_fused_radius, marks=needs_cpp),
    pytest.param(entry_ptx_aggregate, marks=needs_ptx),
]


#: Every operator and entry point, each past and at its limit, under fake tensors.
CASES = OPERATOR_CASES + ENTRY_CASES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_sizes_past_the_limit_are_refused_by_name(case, device):
    with FakeTensorMode(allow_non_fake_inputs=False):
        call, name = case(device, over=True)
        with pytest.raises(ValueError, match=f"^{name}: expected at most "):
            call()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_sizes_at_the_limit_go_through(case, device):
    traces = case in TRACES_THE_LAUNCH or case is entry_triton_aggregate
    if device == "cuda" and traces and not torch.cuda.is_available():
        pytest.skip("the Triton operator traces its kernel launch: needs CUDA")
    with FakeTensorMode(allow_non_fake_inputs=False):
        call, _ = case(device, over=False)
        out = call()
    outs = out if isinstance(out, tuple) else (out,)
    assert all(t.dim() == 0 or t.shape[0] > 0 for t in outs)


# ------------------------------------------- real implementations, on the CPU
# A product of sizes passes the limit while every tensor stays small: the refusal
# comes before any work (nothing of 2^31 elements is ever allocated).


@needs_triton
def test_triton_operator_and_entry_point_refuse_on_the_cpu():
    q = torch.zeros(2**16, 3)
    few = torch.zeros(1, 3)
    wide = torch.zeros(1, 2**15)  # 2^16 queries x 2^15 features = 2^31
    with pytest.raises(ValueError, match="^p_query: expected at most 2147483647 "):
        torch.ops.triton_knn.knn_aggregate_fwd(q, few, wide, 1, 0.1)
    with pytest.raises(ValueError, match="^p_query: expected at most 2147483647 "):
        extkernels.knn_aggregate(q, few, wide, 1, 0.1, backend="triton")
    many = torch.randn(2**15, 3)  # 2^16 queries x 2^15 neighbours = 2^31
    with pytest.raises(ValueError, match="^p_query: .* queries × neighbours"):
        torch.ops.triton_knn.knn_aggregate_fwd(q, many, torch.zeros(2**15, 1), 2**15, 1)


@needs_triton
def test_triton_backward_refuses_on_the_cpu():
    # Broadcast views: the backward reads no element before it refuses.
    g = torch.zeros(1, 1).expand(2**16, 2**15)
    w = torch.zeros(1, 1).expand(2**16, 4)
    i = torch.zeros(1, 1, dtype=torch.int64).expand(2**16, 4)
    with pytest.raises(ValueError, match="^grad_out: expected at most 2147483647 "):
        torch.ops.triton_knn.knn_aggregate_bwd(g, w, i, 64)
    g = torch.zeros(1, 1).expand(2**16, 1)
    w = torch.zeros(1, 1).expand(2**16, 2**15)
    i = torch.zeros(1, 1, dtype=torch.int64).expand(2**16, 2**15)
    with pytest.raises(ValueError, match="^weights: expected at most 2147483647 "):
        torch.ops.triton_knn.knn_aggregate_bwd(g, w, i, 64)


@needs_ptx
def test_ptx_operator_and_entry_point_refuse_on_the_cpu():
    w, i = torch.full((2**16, 1), 1.0), torch.zeros(2**16, 1, dtype=torch.int64)
    feats = torch.zeros(1, 2**16 + 1)  # 2^16 x (2^16 + 1) threads
    with pytest.raises(ValueError, match="^feats: expected at most 4294967295 "):
        torch.ops.extkernels_ptx.gather(w, i, feats)
    q, r = torch.zeros(2**16, 3), torch.zeros(1, 3)
    with pytest.raises(ValueError, match="^feats: expected at most 4294967295 "):
        extkernels.knn_aggregate(q, r, feats, 1, 0.1, backend="ptx")


# ------------------------------------------------------ under dynamic shapes


def _problem(m, f):
    g = torch.Generator().manual_seed(0)
    p_ref = torch.randn(40, 3, generator=g)
    return torch.randn(m, 3, generator=g), p_ref, torch.randn(40, f, generator=g)


@pytest.mark.parametrize(
    "backend, op",
    [
        pytest.param("triton", "knn_aggregate", marks=needs_triton),
        pytest.param("cpp", "knn_aggregate", marks=needs_cpp),
        pytest.param("fused", "knn_aggregate", marks=needs_cpp),
        pytest.param("fused", "radius_aggregate", marks=needs_cpp),
        pytest.param("ptx", "knn_aggregate", marks=needs_ptx),
    ],
)
def test_limits_take_symbolic_sizes(backend, op):
    # Compiled (Dynamo only, no code generation) with the queries and the features
    # marked dynamic: the limits compare SymInt sizes without specialising them, so
    # one graph serves every size.
    fn = getattr(extkernels, op)
    k_or_radius = 4 if op == "knn_aggregate" else 0.5

    def traced(q, r, feats):
        return fn(q, r, feats, k_or_radius, 0.1, backend=backend)

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(traced, backend=counter, fullgraph=True)
    for m, f in [(30, 5), (50, 7)]:
        q, r, feats = _problem(m, f)
        torch._dynamo.mark_dynamic(q, 0)
        torch._dynamo.mark_dynamic(feats, 1)
        torch.testing.assert_close(compiled(q, r, feats), traced(q, r, feats))
    assert counter.frame_count == 1
