"""The backend conformance suite: every registered backend x every operation it
implements x every device it runs on, against independent references.

A new backend gets all of it by registering (``extkernels.ops.registry.register``):
exact results on random and awkward clouds (duplicate points, tight clusters, a flat
cloud, queries far outside the cloud, a cloud far from the origin), gradients, every bad
input through the entry point, the custom operator and its fake, ``opcheck``, and
``torch.compile(fullgraph=True)`` with zero graph breaks. Cases a machine cannot run are
skipped with the reason; CUDA cases carry the ``gpu`` marker.
"""

import math

import numpy as np
import pytest
import torch
from scipy.spatial import cKDTree
from torch._subclasses.fake_tensor import FakeTensorMode

import extkernels
from extkernels import clouds
from extkernels.ops import registry

K = 7
SIGMA = 0.1
RADIUS = 0.3
N_REF = 600
N_FEATS = 5
OPS = ["knn", "knn_aggregate", "radius_aggregate"]


def cases(op: str) -> list:
    """``(backend, device)`` parameters for ``op``: every registered backend that
    implements it, on every device it names; skipped where it cannot run here."""
    params = []
    for b in registry.registered():
        if not b.implements(op):
            continue
        for device in b.devices:
            marks = [pytest.mark.gpu] if device == "cuda" else []
            if not b.runs_on(device):
                why = f"backend {b.name!r} cannot run on {device} on this machine"
                marks.append(pytest.mark.skip(reason=why))
            params.append(
                pytest.param(b.name, device, marks=marks, id=f"{b.name}-{device}")
            )
    return params


def operator_cases(op: str) -> list:
    """Like :func:`cases`, for backends that implement ``op`` with a custom operator."""
    named = {b.name for b in registry.registered() if b.operators.get(op)}
    return [p for p in cases(op) if p.values[0] in named]


def per_op(ops: list[str], source=None) -> list:
    """``source(op)`` parameters (default :func:`cases`) for every op, with ``op``
    first."""
    source = source or cases
    return [
        pytest.param(op, *p.values, marks=p.marks, id=f"{op}-{p.id}")
        for op in ops
        for p in source(op)
    ]


# ---------------------------------------------------------------- clouds


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cloud(kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = _generator(seed)
    p_ref = torch.randn(N_REF, 3, generator=g)
    p_query = extkernels.query_grid(6)
    if kind == "duplicates":  # every point twice
        p_ref = torch.cat([p_ref[: N_REF // 2], p_ref[: N_REF // 2]])
    elif kind == "clusters":  # five clusters 1e-3 across, and the rest of the cloud
        centres = torch.randn(5, 3, generator=g)
        tight = centres.repeat_interleave(60, 0) + 1e-3 * torch.randn(
            300, 3, generator=g
        )
        p_ref = torch.cat([tight, p_ref[300:]])
        p_query = torch.cat([p_query, centres + 0.05])
    elif kind == "flat":  # every point in the plane z = 0
        p_ref[:, 2] = 0.0
    elif kind == "far queries":  # queries 10 to 100 units away from the cloud
        direction = torch.nn.functional.normalize(
            torch.randn(40, 3, generator=g), dim=1
        )
        p_query = torch.cat([p_query, direction * torch.linspace(10, 100, 40)[:, None]])
    elif kind == "offset 1000":  # coordinates near 1000, as in a scan in millimetres
        p_ref, p_query = p_ref + 1000.0, p_query + 1000.0
    elif kind in REAL_CLOUDS:  # chapter 14's geometry, at the suite's size
        w = clouds.workload(kind, N_REF, side=6, seed=seed)
        p_query, p_ref = w.p_query, w.p_ref
    elif kind != "random":
        raise ValueError(kind)
    return p_query.contiguous(), p_ref.contiguous()


CLOUDS = ["random", "duplicates", "clusters", "flat", "far queries", "offset 1000"]
#: Chapter 14's real and awkward clouds: a CAD surface queried in the volume around
#: it, one far outlier, a thin slab queried at its own points.
REAL_CLOUDS = ["panda", "outlier", "slab"]


def smooth_feats(p_ref: torch.Tensor) -> torch.Tensor:
    """Features that are a function of position: duplicate points share them, so a tie
    between two copies changes no aggregate."""
    w = torch.randn(3, N_FEATS, generator=_generator(7))
    centred = p_ref.double() - p_ref.double().mean(dim=0)
    return torch.sin(centred @ w.double() + 0.5).float()


# ---------------------------------------------------------------- float64 references


def knn_reference(p_query, p_ref, k):
    d, i = cKDTree(p_ref.double().numpy()).query(p_query.double().numpy(), k=k)
    return d.reshape(len(d), k), i.reshape(len(i), k)


def knn_weights(p_query, p_ref, k, sigma) -> np.ndarray:
    """``(M, N)`` aggregation matrix of the kNN aggregation, in float64."""
    d, i = knn_reference(p_query, p_ref, k)
    logits = -d / sigma
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    dense = np.zeros((p_query.shape[0], p_ref.shape[0]))
    np.add.at(dense, (np.arange(len(i))[:, None], i), w)
    return dense


def radius_weights(p_query, p_ref, radius, sigma) -> np.ndarray:
    """``(M, N)`` aggregation matrix of the radius aggregation, in float64."""
    q, r = p_query.double().numpy(), p_ref.double().numpy()
    dense = np.zeros((len(q), len(r)))
    for row, found in enumerate(cKDTree(r).query_ball_point(q, radius)):
        if found:
            d = np.linalg.norm(r[found] - q[row], axis=1)
            w = np.exp(-(d - d.min()) / sigma)
            dense[row, found] = w / w.sum()
    return dense


def aggregate_tolerance(largest_distance: float) -> float:
    """What float32 allows: a distance ``d`` carries an error of a few ulp, ``~d *
    2**-23``, and a weight ``exp(-d / sigma)`` that error divided by sigma, relative
    (queries 100 units away lose four digits of their weights)."""
    return 1e-5 + 4 * 2**-23 * largest_distance / SIGMA


def group_rows(grad: np.ndarray, p_ref: torch.Tensor) -> np.ndarray:
    """Gradient rows summed over reference points at the same position (where the split
    between copies is a tie-break, not a result)."""
    _, inverse = np.unique(p_ref.numpy(), axis=0, return_inverse=True)
    out = np.zeros((inverse.max() + 1, grad.shape[1]))
    np.add.at(out, inverse.reshape(-1), grad)
    return out


def _on(device, *tensors):
    return [t.to(device) for t in tensors]


# ---------------------------------------------------------------- correctness


@pytest.mark.parametrize("cloud", CLOUDS + REAL_CLOUDS)
@pytest.mark.parametrize("backend, device", cases("knn"))
def test_knn_is_exact(backend, device, cloud):
    p_query, p_ref = _cloud(cloud)
    d, i = extkernels.knn(*_on(device, p_query, p_ref), K, backend=backend)
    assert (d.shape, i.shape, d.dtype, i.dtype) == ((len(p_query), K),) * 2 + (
        torch.float32,
        torch.int64,
    )
    assert d.device.type == i.device.type == device
    d, i = d.cpu().double().numpy(), i.cpu().numpy()
    ref_d, _ = knn_reference(p_query, p_ref, K)
    tol = 1e-6 + 1e-6 * ref_d
    assert np.all(np.abs(d - ref_d) <= tol), (
        f"distances off by {np.abs(d - ref_d).max():.3g}"
    )
    # Each index lies at its distance, so ties may come in any order but no point is
    # wrong.
    actual = np.linalg.norm(
        p_query.double().numpy()[:, None] - p_ref.double().numpy()[i], axis=-1
    )
    assert np.all(np.abs(actual - ref_d) <= tol), (
        "an index does not lie at its distance"
    )
    assert all(len(set(row)) == K for row in i.tolist()), "a neighbour came twice"


@pytest.mark.parametrize("cloud", CLOUDS)
@pytest.mark.parametrize(
    "op, backend, device", per_op(["knn_aggregate", "radius_aggregate"])
)
def test_aggregation_and_its_gradient_are_exact(op, backend, device, cloud):
    p_query, p_ref = _cloud(cloud)
    feats = smooth_feats(p_ref)
    grad_out = torch.randn(len(p_query), N_FEATS, generator=_generator(3))
    f = feats.clone().to(device).requires_grad_(True)
    q, r, g = _on(device, p_query, p_ref, grad_out)
    if op == "knn_aggregate":
        out = extkernels.knn_aggregate(q, r, f, K, SIGMA, backend=backend)
        w = knn_weights(p_query, p_ref, K, SIGMA)
        atol = aggregate_tolerance(knn_reference(p_query, p_ref, K)[0].max())
        # which of two copies of a point is the k-th neighbour is a tie-break, not a
        # result
        rows = lambda grad: group_rows(grad, p_ref)  # noqa: E731
    else:
        out = extkernels.radius_aggregate(q, r, f, RADIUS, SIGMA, backend=backend)
        w = radius_weights(p_query, p_ref, RADIUS, SIGMA)
        atol = aggregate_tolerance(RADIUS)
        rows = lambda grad: grad  # noqa: E731
    out.backward(g)
    np.testing.assert_allclose(
        out.detach().cpu().double(), w @ feats.double().numpy(), atol=atol
    )
    expected = rows(w.T @ grad_out.double().numpy())
    np.testing.assert_allclose(rows(f.grad.cpu().double().numpy()), expected, atol=atol)
    empty = torch.from_numpy(
        w.sum(axis=1) == 0
    )  # queries without neighbour: exact zeros
    assert torch.equal(
        out.detach().cpu()[empty], torch.zeros(int(empty.sum()), N_FEATS)
    )


@pytest.mark.parametrize("backend, device", cases("knn"))
def test_knn_with_k_equal_to_the_cloud(backend, device):
    p_query, p_ref = extkernels.query_grid(3), extkernels.reference_cloud(40, seed=2)
    d, i = extkernels.knn(*_on(device, p_query, p_ref), 40, backend=backend)
    assert all(sorted(row) == list(range(40)) for row in i.cpu().tolist())
    np.testing.assert_allclose(d.cpu(), knn_reference(p_query, p_ref, 40)[0], atol=1e-6)


# ---------------------------------------------------------------- misaligned views


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` again as a contiguous view one element past the start of its storage: a
    pointer that is not 16-byte aligned, as a slice of a larger buffer gives."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view_as(t)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    return view


@pytest.mark.parametrize("op, backend, device", per_op(OPS))
def test_misaligned_views_give_the_aligned_result(op, backend, device):
    p_query, p_ref = _cloud("random")
    feats = smooth_feats(p_ref)[:, :4].contiguous()  # 4 features: vector loads
    grad_out = torch.randn(len(p_query), 4, generator=_generator(3))
    q, r, f, g = _on(device, p_query, p_ref, feats, grad_out)

    def run(q, r, f):
        if op == "knn":
            return extkernels.knn(q, r, K, backend=backend)
        f = f.detach().requires_grad_(True)
        fn = getattr(extkernels, op)
        scale = K if op == "knn_aggregate" else RADIUS
        out = fn(q, r, f, scale, SIGMA, backend=backend)
        out.backward(_misaligned(g))
        return out.detach(), f.grad

    expected = run(q, r, f)
    for name, args in {
        "p_query": (_misaligned(q), r, f),
        "p_ref": (q, _misaligned(r), f),
        "feats": (q, r, _misaligned(f)),
    }.items():
        for got, want in zip(run(*args), expected, strict=True):
            torch.testing.assert_close(got, want, msg=f"{backend} {op}: {name}")


# ---------------------------------------------------------------- determinism

NOT_DETERMINISTIC = "does not have a deterministic implementation"


@pytest.fixture
def deterministic(monkeypatch):
    """``torch.use_deterministic_algorithms(True)`` for one test (cuBLAS set up for
    it, as PyTorch asks), the previous mode restored afterwards."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _forward_and_backward(op, backend, device):
    """``op`` of ``backend`` on the clusters cloud (many neighbours shared by many
    queries: atomic additions collide there): its outputs, and the features' gradient
    for the aggregations."""
    p_query, p_ref = _cloud("clusters")
    grad_out = torch.randn(len(p_query), N_FEATS, generator=_generator(3))
    q, r, g = _on(device, p_query, p_ref, grad_out)
    if op == "knn":
        return extkernels.knn(q, r, K, backend=backend)
    f = smooth_feats(p_ref).to(device).requires_grad_(True)
    if op == "knn_aggregate":
        out = extkernels.knn_aggregate(q, r, f, K, SIGMA, backend=backend)
    else:
        out = extkernels.radius_aggregate(q, r, f, RADIUS, SIGMA, backend=backend)
    out.backward(g)
    return out.detach(), f.grad


@pytest.mark.parametrize("op, backend, device", per_op(OPS))
def test_deterministic_mode_repeats_every_bit_or_refuses(
    op, backend, device, deterministic
):
    try:
        first = _forward_and_backward(op, backend, device)
    except RuntimeError as e:  # as PyTorch refuses its own kernels: name and flag
        assert NOT_DETERMINISTIC in str(e), str(e)
        assert "torch.use_deterministic_algorithms(True)" in str(e)
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match=NOT_DETERMINISTIC):
            _forward_and_backward(op, backend, device)
        return
    for _ in range(3):
        again = _forward_and_backward(op, backend, device)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True)), (
            f"{backend} {op} on {device}: a repeated call differs in deterministic mode"
        )


def test_the_alert_raises_warns_or_stays_quiet(deterministic):
    from extkernels.ops.checks import alert_not_deterministic

    with pytest.raises(RuntimeError, match=f"^toy::op {NOT_DETERMINISTIC}, but you"):
        alert_not_deterministic("toy::op")
    torch.use_deterministic_algorithms(True, warn_only=True)
    with pytest.warns(UserWarning, match="toy::op .*'warn_only=True'"):
        alert_not_deterministic("toy::op")
    torch.use_deterministic_algorithms(False)
    alert_not_deterministic("toy::op")  # nothing


# ---------------------------------------------------------------- bad inputs


def _valid(device):
    p_query = extkernels.query_grid(2).to(device)
    p_ref = extkernels.reference_cloud(20).to(device)
    return {
        "p_query": p_query,
        "p_ref": p_ref,
        "feats": extkernels.features(20, 2).to(device),
    }


def _args(op, inputs, k=3, radius=0.5, sigma=0.1):
    p_query, p_ref, feats = inputs["p_query"], inputs["p_ref"], inputs["feats"]
    if op == "knn":
        return (p_query, p_ref, k)
    return (p_query, p_ref, feats, k if op == "knn_aggregate" else radius, sigma)


def _with_value(t, value):
    t = t.clone()
    t[1, 2] = value
    return t


def _non_contiguous(t):
    return t.T.contiguous().T


# (how to spoil a tensor, the error, whether a fake sees it: values are not the fake's
# business, nor is the layout, which inside a compiled graph is the compiler's)
BAD_CLOUDS = {
    "float64": (lambda t: t.double(), TypeError, True),
    "shape (n, 2)": (lambda t: t[:, :2].contiguous(), ValueError, True),
    "1-D": (lambda t: t.reshape(-1), ValueError, True),
    "empty": (lambda t: t[:0], ValueError, True),
    "non-contiguous": (_non_contiguous, ValueError, False),
    "on another device": (lambda t: t.to("meta"), ValueError, True),
    "NaN": (lambda t: _with_value(t, math.nan), ValueError, False),
    "inf": (lambda t: _with_value(t, math.inf), ValueError, False),
}
BAD_FEATS = {
    # (not float64: an operator may take more than float32 features, never integers)
    "int32": (lambda f: f.int(), TypeError),
    "wrong row count": (lambda f: f[:-1].contiguous(), ValueError),
    "1-D": (lambda f: f[:, 0].contiguous(), ValueError),
    "no columns": (lambda f: f[:, :0].contiguous(), ValueError),
    "non-contiguous": (_non_contiguous, ValueError),
    "on another device": (lambda f: f.to("meta"), ValueError),
}
BAD_SCALARS = {
    "k = 0": ("k", 0, ValueError),
    "k > N": ("k", 21, ValueError),
    "radius = 0": ("radius", 0.0, ValueError),
    "radius < 0": ("radius", -0.5, ValueError),
    "radius inf": ("radius", math.inf, ValueError),
    "sigma = 0": ("sigma", 0.0, ValueError),
    "sigma nan": ("sigma", math.nan, ValueError),
}


def _bad_cases(op: str) -> list[tuple]:
    """``(label, spoil(inputs) -> (args, argument name), error, fake sees it)`` for
    ``op``."""
    out = []
    for arg in ("p_query", "p_ref"):
        for label, (spoil, error, fake) in BAD_CLOUDS.items():
            # Two clouds on two devices: p_query's device is the expected one, p_ref is
            # named.
            named = "p_ref" if label == "on another device" else arg

            def make(inputs, arg=arg, spoil=spoil, named=named):
                return _args(op, {**inputs, arg: spoil(inputs[arg])}), named

            out.append((f"{arg} {label}", make, error, fake))
    if op != "knn":
        for label, (spoil, error) in BAD_FEATS.items():

            def make(inputs, spoil=spoil):
                return _args(op, {**inputs, "feats": spoil(inputs["feats"])}), "feats"

            out.append((f"feats {label}", make, error, label != "non-contiguous"))
    for label, (name, value, error) in BAD_SCALARS.items():
        if (
            name == "k"
            and op == "radius_aggregate"
            or name == "radius"
            and op != "radius_aggregate"
        ):
            continue
        if name == "sigma" and op == "knn":
            continue

        def make(inputs, name=name, value=value):
            return _args(op, inputs, **{name: value}), name

        out.append((label, make, error, True))
    return out


def _bad_params(op: str, *, operators: bool = False) -> list:
    params = []
    for p in operator_cases(op) if operators else cases(op):
        backend, device = p.values
        for label, make, error, fake in _bad_cases(op):
            params.append(
                pytest.param(
                    backend,
                    device,
                    make,
                    error,
                    fake,
                    marks=p.marks,
                    id=f"{p.id}-{label}",
                )
            )
    return params


def _operator(backend: str, op: str):
    return next(b for b in registry.registered() if b.name == backend).operator(op)


ARGUMENTS = {
    "knn": {"p_query", "p_ref", "k"},
    "knn_aggregate": {"p_query", "p_ref", "feats", "k", "sigma"},
    "radius_aggregate": {"p_query", "p_ref", "feats", "radius", "sigma"},
}


@pytest.mark.parametrize("op", OPS)
def test_bad_cases_cover_every_argument(op):
    assert {make(_valid("cpu"))[1] for _, make, _, _ in _bad_cases(op)} == ARGUMENTS[op]


@pytest.mark.parametrize("backend, device, make, error, fake", _bad_params("knn"))
def test_knn_entry_point_rejects(backend, device, make, error, fake):
    args, name = make(_valid(device))
    with pytest.raises(error, match=f"^{name}:"):
        extkernels.knn(*args, backend=backend)


@pytest.mark.parametrize(
    "backend, device, make, error, fake", _bad_params("knn_aggregate")
)
def test_knn_aggregate_entry_point_rejects(backend, device, make, error, fake):
    args, name = make(_valid(device))
    with pytest.raises(error, match=f"^{name}:"):
        extkernels.knn_aggregate(*args, backend=backend)


@pytest.mark.parametrize(
    "backend, device, make, error, fake", _bad_params("radius_aggregate")
)
def test_radius_aggregate_entry_point_rejects(backend, device, make, error, fake):
    args, name = make(_valid(device))
    with pytest.raises(error, match=f"^{name}:"):
        extkernels.radius_aggregate(*args, backend=backend)


@pytest.mark.parametrize(
    "op, backend, device, make, error, fake",
    per_op(OPS, lambda op: _bad_params(op, operators=True)),
)
def test_custom_operator_rejects(op, backend, device, make, error, fake):
    # Called directly, without the entry point's checks in front of it.
    args, name = make(_valid(device))
    with pytest.raises(error, match=f"^{name}:"):
        _operator(backend, op)(*args)


@pytest.mark.parametrize(
    "op, backend, device, make, error, fake",
    per_op(OPS, lambda op: _bad_params(op, operators=True)),
)
def test_fake_implementation_rejects(op, backend, device, make, error, fake):
    # The fake runs the operator's metadata checks (device included): a compiled caller
    # fails at trace time. Values are not a fake's business: it never sees them.
    if not fake:
        pytest.skip("a fake checks neither values nor the layout")
    args, name = make(_valid(device))
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_args = [
            mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args
        ]
        with pytest.raises(error, match=f"^{name}:"):
            _operator(backend, op)(*fake_args)


@pytest.mark.parametrize(
    "op, backend, device",
    per_op(["knn_aggregate", "radius_aggregate"], operator_cases),
)
def test_fake_takes_features_of_any_strides(op, backend, device):
    # Inside a compiled graph the strides are the compiler's (see the next section): the
    # fake gives the output's shape for a strided view of the features too.
    inputs = _valid(device)
    inputs["feats"] = _non_contiguous(inputs["feats"])
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_args = [
            mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
            for a in _args(op, inputs)
        ]
        out = _operator(backend, op)(*fake_args)
    out = out[0] if isinstance(out, tuple) else out
    assert out.shape == (inputs["p_query"].shape[0], inputs["feats"].shape[1])


# ------------------------------------------------------- operators and the compiler


def _example(op: str, device: str) -> tuple:
    p_query, p_ref = _cloud("random")
    feats = smooth_feats(p_ref).to(device).requires_grad_(True)
    inputs = {"p_query": p_query.to(device), "p_ref": p_ref.to(device), "feats": feats}
    return _args(op, inputs, k=K, radius=RADIUS, sigma=SIGMA)


@pytest.mark.parametrize("op, backend, device", per_op(OPS, operator_cases))
def test_opcheck(op, backend, device):
    # All of opcheck's tests: schema, autograd registration, fake tensor, AOT dispatch
    # with dynamic shapes.
    torch.library.opcheck(_operator(backend, op), _example(op, device))


@pytest.mark.parametrize("op, backend, device", per_op(OPS))
def test_compiles_with_fullgraph_and_matches_eager(op, backend, device):
    torch._dynamo.reset()
    args = _example(op, device)
    weights = torch.linspace(0.5, 1.5, K if op == "knn" else N_FEATS, device=device)

    def loss(*args):
        out = getattr(extkernels, op)(*args, backend=backend)
        if op == "knn":
            return (out[0] * weights).sum() + out[1].sum()
        return (out * weights).sum()

    explanation = torch._dynamo.explain(loss)(*args)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)
    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):
        value = fn(*args)
        grad = torch.autograd.grad(value, args[2])[0] if op != "knn" else None
        results.append((value.detach(), grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-4)
    if op != "knn":
        torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "op, backend, device", per_op(["knn_aggregate", "radius_aggregate"])
)
def test_compiles_when_the_compiler_pads_the_matmul_that_feeds_it(op, backend, device):
    # On a GPU, Inductor may pad a matmul whose width is not a multiple of four and show
    # the operator's fake a slice of the padded result: a strided view of (N, 25). The
    # fake takes it; the kernel is given the layout it needs.
    torch._dynamo.reset()
    p_query, p_ref = _example(op, device)[:2]
    lift = torch.nn.Linear(3, 25, device=device)

    def loss(p_query, p_ref):
        inputs = {"p_query": p_query, "p_ref": p_ref, "feats": lift(p_ref)}
        args = _args(op, inputs, k=K, radius=RADIUS, sigma=SIGMA)
        return getattr(extkernels, op)(*args, backend=backend).square().sum()

    results = []
    with torch._inductor.config.patch(force_shape_pad=True):
        for fn in (loss, torch.compile(loss, fullgraph=True)):
            value = fn(p_query, p_ref)
            results.append((value.detach(), torch.autograd.grad(value, lift.weight)[0]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op, backend, device", per_op(["knn", "knn_aggregate"]))
def test_a_compiled_caller_may_change_k(op, backend, device):
    # The second k makes it a SymInt in the traced graph: the checks take it, the
    # compiled results match eager for each k, and a k beyond the cloud is refused.
    torch._dynamo.reset()
    p_query, p_ref, feats = _example("knn_aggregate", device)[:3]
    inputs = {"p_query": p_query, "p_ref": p_ref, "feats": feats.detach()}

    def search(k):
        args = _args(op, inputs, k=k, sigma=SIGMA)
        out = getattr(extkernels, op)(*args, backend=backend)
        return out[0] if op == "knn" else out

    compiled = torch.compile(search, fullgraph=True)
    for k in (K, K + 2, K + 5):
        torch.testing.assert_close(compiled(k), search(k), rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match=r"k: expected 1 <= k"):
        compiled(N_REF + 1)
