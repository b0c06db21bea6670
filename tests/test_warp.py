"""What is specific to the ``warp`` backend: its two backwards, the grid pool, kept
descriptors and recorded launches, threads, streams and synchronisation (the conformance
suite, tests/test_backends.py, covers what every backend must do).

Runs on the CPU (Warp's CPU device) and, where CUDA is available, on the GPU as well.
Warp compiles its kernels once per machine and device (cached in ~/.cache/warp), so only
the first run of this file pays for it.
"""

import gc
import subprocess
import sys
import weakref

import pandas as pd
import pytest
import torch
from conftest import DEVICES

import extkernels
from extkernels import timing
from extkernels.experiments import traits
from extkernels.experiments import warp_interop as wi
from extkernels.experiments import warp_radius as wr
from extkernels.models import Projector, RadiusAggregation
from extkernels.ops import warp as wb
from extkernels.ops.checks import value_checks
from extkernels.ops.torch import brute_force as torch_backend
from extkernels.ops.warp import grids, interop, saved
from extkernels.ops.warp import ops as wops
from extkernels.training import make_train_step

pytestmark = pytest.mark.skipif(not wb.available(), reason="warp-lang is not installed")

N_REF = 400
GRID_SIDE = 5
N_FEATS = 25
RADIUS = 0.3
SIGMA = 0.1
# float32 sums of a handful of weighted features in a different order than torch's
# matmul
ATOL = RTOL = 1e-5
# A query this far from the (standard normal) cloud has no neighbour within RADIUS.
FAR = 10.0


def problem(device, n_feats=N_FEATS):
    """400 reference points with two duplicated pairs, a 5^3 query grid plus one far
    query."""
    p_ref = extkernels.reference_cloud(N_REF, seed=0)
    p_ref[1] = p_ref[0]
    p_ref[3] = p_ref[2]
    p_query = torch.cat([extkernels.query_grid(GRID_SIDE), torch.full((1, 3), FAR)])
    feats = extkernels.features(N_REF, n_feats, seed=0)
    return p_query.to(device), p_ref.to(device), feats.to(device)


def warp_op(p_query, p_ref, feats, radius=RADIUS, sigma=SIGMA):
    return torch.ops.warp.radius_aggregate(p_query, p_ref, feats, radius, sigma)


FORWARD_OPS = ["radius_aggregate", "radius_aggregate_manual"]
BACKWARD_OPS = ["radius_aggregate_backward", "radius_aggregate_backward_manual"]


def reference_grad(p_query, p_ref, feats, grad_out, dtype):
    f = feats.to(dtype).requires_grad_(True)
    out = torch_backend.radius_aggregate(
        p_query.to(dtype), p_ref.to(dtype), f, RADIUS, SIGMA
    )
    (g,) = torch.autograd.grad(out, f, grad_out.to(dtype))
    return out.detach(), g


def assert_float32_reference_grad(grad, p_query, p_ref, feats, grad_out):
    """``grad`` is the gradient w.r.t. ``feats`` that the torch reference gives in
    float32."""
    _, expected = reference_grad(p_query, p_ref, feats, grad_out, torch.float32)
    torch.testing.assert_close(grad, expected, atol=ATOL, rtol=RTOL)


@pytest.fixture(autouse=True)
def _fresh_grid_cache():
    wb.clear_grid_cache()
    yield
    wb.clear_grid_cache()


@pytest.fixture
def backward_calls(monkeypatch):
    """The kinds of backward ("adjoint" or "manual") that actually ran, in order."""
    calls = []
    impl = wops.backward

    def spy(*args):
        calls.append(args[-1])
        return impl(*args)

    monkeypatch.setattr(wops, "backward", spy)
    return calls


# ---------------------------------------------------------------- registration


def test_warp_backend_is_listed():
    assert "warp" in extkernels.backends("radius_aggregate")


@pytest.mark.slow
def test_importing_the_package_does_not_import_warp():
    code = (
        "import sys, torch, extkernels; "
        "print('warp' in sys.modules, hasattr(torch.ops.warp, 'radius_aggregate'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "True"]


# ---------------------------------------------------------------- forward


# ---------------------------------------------------------------- backward


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", wb.BACKWARDS)
def test_gradient_matches_torch_reference(device, kind, backward_calls):
    p_query, p_ref, feats = problem(device)
    grad_out = torch.randn(p_query.shape[0], N_FEATS, device=device)
    f = feats.clone().requires_grad_(True)
    out = extkernels.radius_aggregate(
        p_query, p_ref, f, RADIUS, SIGMA, backend="warp", backward=kind
    )
    (grad,) = torch.autograd.grad(out, f, grad_out)
    assert backward_calls == [kind]
    _, expected32 = reference_grad(p_query, p_ref, feats, grad_out, torch.float32)
    _, expected64 = reference_grad(p_query, p_ref, feats, grad_out, torch.float64)
    torch.testing.assert_close(grad, expected32, atol=ATOL, rtol=RTOL)
    # gradcheck needs float64 and the op is float32 only: compare with the float64
    # reference
    torch.testing.assert_close(grad.double(), expected64, atol=ATOL, rtol=RTOL)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_both_forward_operators_agree(device):
    p_query, p_ref, feats = problem(device)
    a = torch.ops.warp.radius_aggregate(p_query, p_ref, feats, RADIUS, SIGMA)
    b = torch.ops.warp.radius_aggregate_manual(p_query, p_ref, feats, RADIUS, SIGMA)
    assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_adjoint_and_manual_backward_operators_agree(device):
    p_query, p_ref, feats = problem(device)
    grad_out = torch.randn(p_query.shape[0], N_FEATS, device=device)
    args = (grad_out, p_query, p_ref, feats, RADIUS, SIGMA)
    adjoint = torch.ops.warp.radius_aggregate_backward(*args)
    manual = torch.ops.warp.radius_aggregate_backward_manual(*args)
    assert adjoint.shape == feats.shape
    torch.testing.assert_close(adjoint, manual, atol=ATOL, rtol=RTOL)
    # neither mutates its inputs
    assert bool((args[0] == grad_out).all())


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_of_a_broadcast_output_gradient(device):
    # out.sum() hands the backward an expanded (stride 0) gradient
    p_query, p_ref, feats = problem(device)
    f = feats.clone().requires_grad_(True)
    warp_op(p_query, p_ref, f).sum().backward()
    _, expected = reference_grad(
        p_query,
        p_ref,
        feats,
        torch.ones(p_query.shape[0], N_FEATS, device=device),
        torch.float32,
    )
    torch.testing.assert_close(f.grad, expected, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------- the grid cache


@pytest.mark.parametrize("device", DEVICES)
def test_backward_takes_the_forward_grid_out_of_the_cache(device):
    p_query, p_ref, feats = problem(device)
    for _ in range(3):
        f = feats.clone().requires_grad_(True)
        out = warp_op(p_query, p_ref, f)
        assert wb.grid_cache_size() == 1
        out.square().sum().backward()
        assert wb.grid_cache_size() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_grid_cache_is_bounded_without_backward(device):
    p_query, p_ref, feats = problem(device)
    clouds = [p_ref + 0.01 * i for i in range(grids.POOL.cache_size + 3)]
    with torch.no_grad():
        for cloud in clouds:
            warp_op(p_query, cloud, feats)
    assert wb.grid_cache_size() == grids.POOL.cache_size
    wb.clear_grid_cache()
    assert wb.grid_cache_size() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_backward_rebuilds_a_missing_grid(device):
    p_query, p_ref, feats = problem(device)
    grad_out = torch.randn(p_query.shape[0], N_FEATS, device=device)
    f = feats.clone().requires_grad_(True)
    out = warp_op(p_query, p_ref, f)
    wb.clear_grid_cache()
    (grad,) = torch.autograd.grad(out, f, grad_out)
    assert_float32_reference_grad(grad, p_query, p_ref, feats, grad_out)


@pytest.mark.parametrize("device", DEVICES)
def test_a_cloud_changed_in_place_does_not_reuse_its_old_grid(device):
    p_query, p_ref, feats = problem(device)
    grad_out = torch.randn(p_query.shape[0], N_FEATS, device=device)
    cloud = p_ref.clone()
    with torch.no_grad():
        warp_op(
            p_query, cloud, feats
        )  # leaves a grid over the old contents in the cache
    cloud.mul_(0.5)  # same memory, new contents (and a new version counter)
    for op in (torch.ops.warp.radius_aggregate, torch.ops.warp.radius_aggregate_manual):
        torch.testing.assert_close(
            op(p_query, cloud, feats, RADIUS, SIGMA),
            torch_backend.radius_aggregate(p_query, cloud, feats, RADIUS, SIGMA),
            atol=ATOL,
            rtol=RTOL,
        )
    wb.clear_grid_cache()
    with torch.no_grad():
        warp_op(p_query, cloud, feats)
    cloud.mul_(2.0)
    grad = torch.ops.warp.radius_aggregate_backward(
        grad_out, p_query, cloud, feats, RADIUS, SIGMA
    )
    assert_float32_reference_grad(grad, p_query, cloud, feats, grad_out)
    assert (
        wb.grid_cache_size() == 1
    )  # the stale grid was not taken (the LRU evicts it later)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("second", ["other queries", "other sigma"])
def test_backward_of_an_earlier_forward_over_the_same_cloud(device, second):
    # Two forwards share p_ref but not the normalisers: the backward of the first must
    # not take what the second left in the cache.
    p_query, p_ref, feats = problem(device)
    grad_out = torch.randn(p_query.shape[0], N_FEATS, device=device)
    f = feats.clone().requires_grad_(True)
    out = warp_op(p_query, p_ref, f)
    if second == "other queries":
        warp_op(0.5 * p_query, p_ref, f)
    else:
        warp_op(p_query, p_ref, f, sigma=2 * SIGMA)
    (grad,) = torch.autograd.grad(out, f, grad_out)
    assert_float32_reference_grad(grad, p_query, p_ref, feats, grad_out)


@pytest.mark.parametrize("device", DEVICES)
def test_one_walk_forward_leaves_the_normaliser_kernels_values(device):
    # The forward's fused kernel stores shift and 1 / sum for the backward; the
    # backward's rebuild path computes them with the `normaliser` kernel. Both must
    # agree.
    p_query, p_ref, feats = problem(device)
    with torch.no_grad():
        warp_op(p_query, p_ref, feats)
    entry = grids.POOL.take(grids.entry_key(p_query, p_ref, RADIUS, SIGMA))
    where = interop.where(p_ref.device)
    fresh = wops.new_entry(p_query, p_ref, RADIUS, where)
    args = [fresh.grid_id, *fresh.points, RADIUS, SIGMA, *fresh.norm_descs]
    interop.launch(wops.kernels().normaliser, (p_query.shape[0],), args, where)
    for stored, recomputed in zip(entry.norms, fresh.norms, strict=True):
        torch.testing.assert_close(stored, recomputed, atol=1e-6, rtol=1e-6)
    assert float(entry.norms[1][-1]) == pytest.approx(
        1 / torch.finfo(torch.float32).tiny
    )


@pytest.mark.parametrize("device", DEVICES)
def test_steady_state_rebuilds_spare_grids_instead_of_allocating(device, monkeypatch):
    p_query, p_ref, feats = problem(device)
    wp = wb.init()
    step = lambda: (
        warp_op(p_query, p_ref, feats.clone().requires_grad_(True)).sum().backward()
    )  # noqa: E731
    for _ in range(3):
        step()
    created = []
    real = wp.HashGrid

    class Counting(real):
        def __init__(self, *args, **kwargs):
            created.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(wp, "HashGrid", Counting)
    if device == "cuda":
        torch.cuda.synchronize()
    for _ in range(5):
        step()
    assert created == []


@pytest.mark.parametrize("device", DEVICES)
def test_cached_descriptors_equal_fresh_ones(device):
    # A cached descriptor stands for address, shape, strides and dtype, and nothing
    # else.
    wp = wb.init()
    p_query, p_ref, feats = problem(device)

    def fields(d):
        return (
            d.data,
            d.grad,
            d.ndim,
            tuple(d.shape[: d.ndim]),
            tuple(d.strides[: d.ndim]),
        )

    for t, dtype in (
        (p_ref, wp.vec3),
        (feats, None),
        (feats[:7], None),
        (p_ref[1:], wp.vec3),
    ):
        cached = interop.descriptor(t, dtype)
        assert interop.descriptor(t, dtype) is cached
        fresh = wp.from_torch(t, dtype=dtype, requires_grad=False, return_ctype=True)
        assert fields(cached) == fields(fresh)
    # Same address, other shape: another descriptor.
    assert interop.descriptor(feats[:7]) is not interop.descriptor(feats)
    points = interop.points_array(p_ref, interop.where(p_ref.device).device)
    assert (points.ptr, points.shape) == (p_ref.data_ptr(), (p_ref.shape[0],))


@pytest.mark.parametrize("device", DEVICES)
def test_a_kept_descriptor_does_not_keep_its_tensor_alive(device):
    t = torch.randn(64, 3, device=device)
    alive = weakref.ref(t)
    interop.descriptor(t, interop.warp().vec3)  # kept in the cache
    del t
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("device", DEVICES)
def test_recorded_launch_follows_changed_arguments(device):
    # A replayed launch writes only the arguments that changed: new tensors at new
    # addresses, a new sigma, a tensor at an address seen before. Each call must match
    # the reference.
    p_query, p_ref, feats = problem(device)
    cases = [
        (feats, SIGMA),
        (feats * 2, SIGMA),
        (feats, 0.05),
        (feats + 1, 0.05),
        (feats, SIGMA),
    ]
    for f, sigma in cases:
        got = warp_op(p_query, p_ref, f, sigma=sigma)
        want = torch_backend.radius_aggregate(p_query, p_ref, f, RADIUS, sigma)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("device", DEVICES)
def test_operators_run_from_several_threads(device):
    # Recorded launch commands are per thread: concurrent callers must not overwrite
    # each other's parameters.
    import threading

    p_query, p_ref, feats = problem(device)
    expected = torch_backend.radius_aggregate(p_query, p_ref, feats, RADIUS, SIGMA)
    results, errors = [], []

    def work(scale):
        try:
            for _ in range(20):
                out = torch.ops.warp.radius_aggregate_manual(
                    p_query, p_ref, scale * feats, RADIUS, SIGMA
                )
                results.append((scale, out))
        except Exception as e:  # surfaced below
            errors.append(e)

    for _ in range(3):  # a race shows only now and then: give it several chances
        threads = [threading.Thread(target=work, args=(s,)) for s in (1.0, 2.0, 3.0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    assert len(results) == 180
    if device == "cuda":
        torch.cuda.synchronize()
    for scale, out in results:
        torch.testing.assert_close(out, scale * expected, atol=3 * ATOL, rtol=RTOL)


# ---------------------------------------------------------------- operator checks


def _opcheck_args(device):
    p_query, p_ref, feats = problem(device, n_feats=3)
    grad_out = torch.randn(p_query.shape[0], 3, device=device)
    forward = (p_query, p_ref, feats.clone().requires_grad_(True), RADIUS, SIGMA)
    # the backward operators are not differentiable themselves (no double backward):
    # their inputs do not require grad
    backward = (grad_out, p_query, p_ref, feats, RADIUS, SIGMA)
    return {
        **dict.fromkeys(FORWARD_OPS, forward),
        **dict.fromkeys(BACKWARD_OPS, backward),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["radius_aggregate_manual"] + BACKWARD_OPS)
def test_opcheck(device, name):
    # The forward operator is opchecked by the conformance suite; these are the others.
    # All of opcheck's default tests apply (schema, autograd registration, fake tensor,
    # AOT dispatch with dynamic shapes).
    op = getattr(torch.ops.warp, name).default
    torch.library.opcheck(op, _opcheck_args(device)[name])


# ---------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", wb.BACKWARDS)
def test_compiled_forward_and_backward_without_graph_breaks(
    device, kind, backward_calls
):
    torch._dynamo.reset()
    p_query, p_ref, feats = problem(device, n_feats=4)
    weights = torch.randn(4, device=device)

    def loss_fn(p_query, p_ref, feats):
        out = extkernels.radius_aggregate(
            p_query, p_ref, feats, RADIUS, SIGMA, backend="warp", backward=kind
        )
        return (out * weights).sum()

    explanation = torch._dynamo.explain(loss_fn)(p_query, p_ref, feats)
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1
    compiled = torch.compile(loss_fn, fullgraph=True)
    results = []
    for fn in (loss_fn, compiled):
        f = feats.clone().requires_grad_(True)
        loss = fn(p_query, p_ref, f)
        loss.backward()
        results.append((loss.detach(), f.grad))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-4, rtol=RTOL)
    torch.testing.assert_close(results[1][1], results[0][1], atol=ATOL, rtol=RTOL)
    # eager and compiled both ran the chosen backward (compiled-graph caches did not mix
    # them up), and the compiled backward took its grid out of the cache too
    assert backward_calls == [kind, kind]
    assert wb.grid_cache_size() == 0


# ---------------------------------------------------------------- bad inputs


def _names(arg):
    return rf"^{arg}: "


def test_wrong_output_gradient_is_rejected():
    p_query, p_ref, feats = problem("cpu")
    grad_out = torch.randn(p_query.shape[0], N_FEATS + 1)
    for op in (
        torch.ops.warp.radius_aggregate_backward,
        torch.ops.warp.radius_aggregate_backward_manual,
    ):
        with pytest.raises(ValueError, match=_names("grad_out")):
            op(grad_out, p_query, p_ref, feats, RADIUS, SIGMA)


def test_value_checks_can_be_turned_off():
    # Without the check a NaN point is never within the radius: it drops out of every
    # sum.
    p_query, p_ref, feats = problem("cpu")
    p_ref[7] = float("nan")
    with value_checks(False):
        out = warp_op(p_query, p_ref, feats)
    keep = torch.arange(N_REF) != 7
    expected = torch_backend.radius_aggregate(
        p_query, p_ref[keep], feats[keep], RADIUS, SIGMA
    )
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def test_unknown_backward_is_rejected():
    p_query, p_ref, feats = problem("cpu")
    with pytest.raises(ValueError, match=_names("backward")):
        extkernels.radius_aggregate(
            p_query, p_ref, feats, RADIUS, SIGMA, backend="warp", backward="tape"
        )


# ---------------------------------------------------------------- no synchronisation


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", wb.BACKWARDS)
def test_forward_and_backward_do_not_wait_for_the_gpu(kind):
    # The GPU is kept busy by a long sleep kernel queued first on PyTorch's stream. Had
    # the forward or the backward waited for the device (PyTorch's or Warp's
    # synchronisation), the sleep would be over when they return.
    p_query, p_ref, feats = problem("cuda")
    f = feats.clone().requires_grad_(True)

    op = (
        torch.ops.warp.radius_aggregate
        if kind == "adjoint"
        else torch.ops.warp.radius_aggregate_manual
    )

    def forward_backward():
        # the operator itself: the public entry point checks values in eager mode (a
        # sync)
        op(p_query, p_ref, f, RADIUS, SIGMA).square().sum().backward()

    with value_checks(False):  # the one synchronisation there is, by design
        forward_backward()  # warm-up: Warp loads its CUDA module once
        torch.cuda.synchronize()
        done = torch.cuda.Event()
        previous = torch.cuda.get_sync_debug_mode()
        traits.spin(1000.0)  # a second of work queued before ours
        torch.cuda.set_sync_debug_mode("error")  # PyTorch-side synchronisations raise
        try:
            forward_backward()
            done.record()
            assert not done.query(), "the host waited for the GPU"
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    _, expected = reference_grad(
        p_query, p_ref, feats, 2 * warp_op(p_query, p_ref, feats), torch.float32
    )
    f.grad = None
    forward_backward()
    torch.testing.assert_close(f.grad, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("changed", ["p_query", "p_ref"])
def test_a_cloud_changed_in_place_after_the_forward_is_refused_by_the_backward(
    device, changed
):
    """PyTorch's check of the tensors saved for the backward stops a backward over a
    cloud written since its forward, before the pool is asked for its grid."""
    p_query, p_ref, feats = problem(device)
    f = feats.clone().requires_grad_(True)
    out = warp_op(p_query, p_ref, f)
    {"p_query": p_query, "p_ref": p_ref}[changed].mul_(1.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    # a new forward on the changed cloud gets its own grid: the gradient is exact
    f.grad = None
    warp_op(p_query, p_ref, f).square().sum().backward()
    grad_out = 2 * warp_op(p_query, p_ref, feats)
    _, expected = reference_grad(p_query, p_ref, feats, grad_out, torch.float64)
    torch.testing.assert_close(f.grad, expected.float(), atol=ATOL, rtol=RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runs_on_a_side_stream():
    p_query, p_ref, feats = problem("cuda")
    expected = torch_backend.radius_aggregate(p_query, p_ref, feats, RADIUS, SIGMA)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        traits.spin(50.0)  # work queued before ours on the side stream
        f = feats.clone().requires_grad_(True)
        out = warp_op(p_query, p_ref, f)
        out.sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    assert f.grad is not None


# ---------------------------------------------------------------- in the model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", wb.BACKWARDS)
def test_projector_training_step_reduces_the_loss(device, kind):
    p_query, p_ref, _ = problem(device)
    target = extkernels.targets(p_query.shape[0], seed=0, device=device)
    torch.manual_seed(0)
    model = Projector(
        RadiusAggregation(RADIUS, SIGMA, backend="warp", backward=kind)
    ).to(device)
    step = make_train_step(model, model.parameters(), p_query, p_ref, target, lr=1e-2)
    losses = [float(step()) for _ in range(8)]
    assert losses[-1] < losses[0]
    assert wb.grid_cache_size() == 0


def test_weights_do_not_underflow_when_radius_is_many_sigmas():
    # exp(-d / sigma) is 0 in float32 for d / sigma > ~103; the shift by the nearest
    # distance keeps the normalised weights exact: both points weigh in, the nearer far
    # more.
    p_ref = torch.tensor([[0.0, 0.0, 0.0], [0.05, 0.0, 0.0]])
    p_query = torch.tensor([[1.2, 0.0, 0.0]])
    feats = torch.tensor([[1.0], [2.0]])
    out = warp_op(p_query, p_ref, feats, radius=1.5, sigma=0.01)
    w_far = 1.0 / (
        1.0 + torch.exp(torch.tensor(5.0)).item()
    )  # exp(-(1.2 - 1.15) / 0.01)
    torch.testing.assert_close(out, torch.tensor([[1.0 * w_far + 2.0 * (1 - w_far)]]))
    torch.testing.assert_close(
        out,
        torch_backend.radius_aggregate(p_query, p_ref, feats, 1.5, 0.01),
        atol=1e-6,
        rtol=0,
    )


@pytest.mark.parametrize("n_feats", [1, 3, 4, 5, 8])
@pytest.mark.parametrize("kind", wb.BACKWARDS)
def test_feature_counts_that_do_not_fill_a_chunk(n_feats, kind):
    # Each thread handles CHUNK features; the columns past F must neither be written nor
    # receive gradient.
    p_query, p_ref, feats = problem("cpu", n_feats=n_feats)
    f = feats.clone().requires_grad_(True)
    grad_out = torch.randn(
        p_query.shape[0], n_feats, generator=torch.Generator().manual_seed(3)
    )
    out = extkernels.radius_aggregate(
        p_query, p_ref, f, RADIUS, SIGMA, backend="warp", backward=kind
    )
    out.backward(grad_out)
    expected, expected_grad = reference_grad(
        p_query, p_ref, feats, grad_out, torch.float64
    )
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(f.grad.double(), expected_grad, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["from_torch", "recorded launch"])
def test_saxpy_methods_follow_new_tensors_and_sizes(device, method):
    # A recorded launch must take the new tensors and size of every call, not replay the
    # first.
    for n in (1024, 37, 1024):
        x = torch.randn(n, device=device)
        y = torch.ones(n, device=device)
        wi.launch_saxpy(x, y, 2.0, method)
        torch.testing.assert_close(y, 2.0 * x + 1.0)
    with pytest.raises(ValueError, match="method: expected one of"):
        wi.launch_saxpy(x, y, 2.0, "by hand")


@pytest.mark.parametrize("device", DEVICES)
def test_kept_descriptors_keep_no_tensor_alive(device):
    # wp.from_torch attaches the tensor to its descriptor; the kept ones must not hold
    # it, or the cache would keep tensors and their autograd graphs (and memory) alive.
    import gc
    import weakref

    p_query, p_ref, feats = problem(device)
    lifted = (feats * 2.0).requires_grad_(True)
    hidden = lifted * 1.5  # an intermediate with an autograd graph behind it
    warp_op(p_query, p_ref, hidden).sum().backward()
    alive = [weakref.ref(t) for t in (lifted, hidden)]
    del lifted, hidden
    gc.collect()
    assert [r() for r in alive] == [None, None]


# ---------------------------------------------------------------- fixed bugs


@pytest.mark.parametrize("device", DEVICES)
def test_a_kept_descriptor_is_not_reused_for_another_dtype_at_the_same_address(device):
    # An int64 tensor at the address and shape of an earlier float32 one has twice the
    # byte strides: a key without the dtype handed it the float32 descriptor.
    wb.init()
    words = torch.arange(16, dtype=torch.int64, device=device)
    floats = words.view(torch.float32)[:16]
    assert (floats.data_ptr(), floats.shape, floats.stride()) == (
        words.data_ptr(),
        words.shape,
        words.stride(),
    )
    first = interop.descriptor(floats)
    second = interop.descriptor(words)
    assert second is not first
    assert (first.strides[0], second.strides[0]) == (4, 8)


@pytest.mark.parametrize("device", DEVICES)
def test_clear_grid_cache_frees_the_spare_grids_too(device):
    p_query, p_ref, feats = problem(device)
    for _ in range(2):
        warp_op(p_query, p_ref, feats.clone().requires_grad_(True)).sum().backward()
    assert grids.POOL.spare_count() > 0 and wb.grid_cache_size() == 0
    with torch.no_grad():
        warp_op(p_query, p_ref, feats)
    assert wb.grid_cache_size() == 1
    wb.clear_grid_cache()
    assert (wb.grid_cache_size(), grids.POOL.spare_count()) == (0, 0)
    # and the backend still works afterwards
    torch.testing.assert_close(
        warp_op(p_query, p_ref, feats),
        torch_backend.radius_aggregate(p_query, p_ref, feats, RADIUS, SIGMA),
        atol=ATOL,
        rtol=RTOL,
    )


def test_an_unknown_backward_kind_is_an_error():
    p_query, p_ref, feats = problem("cpu")
    grad_out = torch.zeros(p_query.shape[0], N_FEATS)
    with pytest.raises(ValueError, match="^kind: expected one of"):
        wops.backward(grad_out, p_query, p_ref, feats, RADIUS, SIGMA, "tape")


# ---------------------------------------------------------------- the simple hand-over
# (ctx)


@pytest.mark.parametrize("device", DEVICES)
def test_saved_handover_gives_the_reference_gradient_and_keeps_no_grid(device):
    p_query, p_ref, feats = problem(device)
    grad_out = torch.randn(p_query.shape[0], N_FEATS, device=device)
    f = feats.clone().requires_grad_(True)
    out = extkernels.radius_aggregate(
        p_query, p_ref, f, RADIUS, SIGMA, backend="warp", handover="saved"
    )
    assert (
        wb.grid_cache_size() == 0
    )  # the normalisers travel through ctx, the grid not at all
    (grad,) = torch.autograd.grad(out, f, grad_out)
    expected_out, _ = reference_grad(p_query, p_ref, feats, grad_out, torch.float32)
    torch.testing.assert_close(out, expected_out, atol=ATOL, rtol=RTOL)
    assert_float32_reference_grad(grad, p_query, p_ref, feats, grad_out)


@pytest.mark.parametrize("device", DEVICES)
def test_saved_handover_refuses_position_grads_and_names_the_pool(device):
    p_query, p_ref, feats = problem(device)
    q = p_query.clone().requires_grad_(True)
    with pytest.raises(ValueError, match=r"^p_query requires grad; .*handover='pool'"):
        extkernels.radius_aggregate(
            q, p_ref, feats, RADIUS, SIGMA, backend="warp", handover="saved"
        )


@pytest.mark.parametrize("device", DEVICES)
def test_saved_forward_returns_the_normalisers_the_pool_would_keep(device):
    p_query, p_ref, feats = problem(device)
    _, norms = torch.ops.warp.radius_aggregate_saved(
        p_query, p_ref, feats, RADIUS, SIGMA
    )
    with torch.no_grad():
        warp_op(p_query, p_ref, feats)
    entry = grids.POOL.take(grids.entry_key(p_query, p_ref, RADIUS, SIGMA))
    torch.testing.assert_close(norms, entry.norms, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "name", ["radius_aggregate_saved", "radius_aggregate_backward_saved"]
)
def test_opcheck_saved(device, name):
    p_query, p_ref, feats = problem(device, n_feats=3)
    if name == "radius_aggregate_saved":
        args = (p_query, p_ref, feats.clone().requires_grad_(True), RADIUS, SIGMA)
    else:
        _, norms = torch.ops.warp.radius_aggregate_saved(
            p_query, p_ref, feats, RADIUS, SIGMA
        )
        grad_out = torch.randn(p_query.shape[0], 3, device=device)
        args = (grad_out, p_query, p_ref, feats, norms, RADIUS, SIGMA)
    torch.library.opcheck(getattr(torch.ops.warp, name).default, args)


def test_saved_handover_compiles_without_graph_breaks():
    torch._dynamo.reset()
    p_query, p_ref, feats = problem("cpu", n_feats=4)

    def loss_fn(p_query, p_ref, feats):
        out = extkernels.radius_aggregate(
            p_query, p_ref, feats, RADIUS, SIGMA, backend="warp", handover="saved"
        )
        return (out * torch.arange(1.0, 5.0)).sum()

    explanation = torch._dynamo.explain(loss_fn)(p_query, p_ref, feats)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)
    grads = []
    for fn in (loss_fn, torch.compile(loss_fn, fullgraph=True)):
        f = feats.clone().requires_grad_(True)
        fn(p_query, p_ref, f).backward()
        grads.append(f.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=ATOL, rtol=RTOL)


def test_saved_handover_rejects_bad_options_and_normalisers():
    p_query, p_ref, feats = problem("cpu")
    with pytest.raises(ValueError, match="^handover: expected one of"):
        extkernels.radius_aggregate(
            p_query, p_ref, feats, RADIUS, SIGMA, backend="warp", handover="tape"
        )
    with pytest.raises(ValueError, match="^backward: the 'saved' hand-over"):
        extkernels.radius_aggregate(
            p_query,
            p_ref,
            feats,
            RADIUS,
            SIGMA,
            backend="warp",
            handover="saved",
            backward="manual",
        )
    grad_out = torch.zeros(p_query.shape[0], N_FEATS)
    for norms in (
        torch.zeros(3, p_query.shape[0]),
        torch.zeros(2, p_query.shape[0]).double(),
    ):
        with pytest.raises(
            ValueError, match="^norms: expected a float32 tensor of shape"
        ):
            torch.ops.warp.radius_aggregate_backward_saved(
                grad_out, p_query, p_ref, feats, norms, RADIUS, SIGMA
            )


# ---------------------------------------------------------------- the recipe's pieces


def test_attach_backward_routes_the_gradient_of_feats_to_the_backward_op():
    # A forward operator of zeros with a stand-in backward: the gradient of feats must
    # be the backward's result, computed from a contiguous output gradient and the
    # forward's floats. (The clouds' gradient, through the positions operator, is held
    # to the torch reference by the conformance suite.)
    @torch.library.custom_op("warp_test::attach_backward", mutates_args=())
    def zeros_op(
        p_query: torch.Tensor,
        p_ref: torch.Tensor,
        feats: torch.Tensor,
        radius: float,
        sigma: float,
    ) -> torch.Tensor:
        return p_query.new_zeros((p_query.shape[0], feats.shape[1]))

    seen = []

    def backward_op(grad_out, p_query, p_ref, feats, radius, sigma):
        seen.append((grad_out.is_contiguous(), radius, sigma))
        return torch.full_like(feats, 7.0)

    wops.attach_backward(zeros_op, backward_op)
    p_query, p_ref, feats = problem("cpu")
    f = feats.clone().requires_grad_(True)
    zeros_op(p_query, p_ref, f, RADIUS, SIGMA).sum().backward()  # sum's: an expand
    assert seen == [(True, RADIUS, SIGMA)]
    assert torch.equal(f.grad, torch.full_like(feats, 7.0))


def test_the_saved_hand_over_refuses_clouds_that_require_grad():
    # warp::radius_aggregate_saved differentiates the features only: a cloud that asks
    # for a gradient is refused at forward time, by name, rather than left without one.
    p_query, p_ref, feats = problem("cpu")
    q = p_query.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="^p_query requires grad; backend 'warp'"):
        extkernels.radius_aggregate(
            q, p_ref, feats, RADIUS, SIGMA, backend="warp", handover="saved"
        )


def test_fakes_give_the_shapes_and_check_the_contract():
    from torch._subclasses.fake_tensor import FakeTensorMode

    p_query, p_ref, feats = problem("cpu")
    with FakeTensorMode() as mode:
        q, r, f = (mode.from_tensor(t) for t in (p_query, p_ref, feats))
        g = mode.from_tensor(torch.zeros(p_query.shape[0], N_FEATS))
        assert wops.forward_fake(q, r, f, RADIUS, SIGMA).shape == (p_query.shape[0], 25)
        assert wops.backward_fake(g, q, r, f, RADIUS, SIGMA).shape == feats.shape
        with pytest.raises(ValueError, match="radius"):
            wops.forward_fake(q, r, f, -1.0, SIGMA)


def test_launch_online_leaves_the_normalisers_and_forward_keeps_the_grid():
    p_query, p_ref, feats = problem("cpu")
    entry, out = wops.launch_online(p_query, p_ref, feats, RADIUS, SIGMA)
    grids.POOL.release(entry)
    assert entry.norms.shape == (2, p_query.shape[0])
    torch.testing.assert_close(out, warp_op(p_query, p_ref, feats))
    wb.clear_grid_cache()
    wops.forward(p_query, p_ref, feats, RADIUS, SIGMA)
    assert wb.grid_cache_size() == 1


def test_saved_setup_context_keeps_the_normalisers():
    class Ctx:
        needs_input_grad = (False, False, True, False, False)

        def save_for_backward(self, *tensors):
            self.saved = tensors

    p_query, p_ref, feats = problem("cpu")
    norms = torch.zeros(2, p_query.shape[0])
    ctx = Ctx()
    saved.setup_context(ctx, (p_query, p_ref, feats, RADIUS, SIGMA), (None, norms))
    assert ctx.saved[-1] is norms and (ctx.radius, ctx.sigma) == (RADIUS, SIGMA)


# ---------------------------------------------------------------- chapter helpers


def timing_table(times: dict[str, tuple[list[float], list[float]]]) -> pd.DataFrame:
    """A timing table like benchmark.run_all's: variant -> (forward runs, train runs);
    peak memory 100 MiB for radius/torch, 4 for the rest."""
    rows = [
        {
            "variant": name,
            "workload": "radius",
            "forward_ms": fwd,
            "train_ms": train,
            "peak_mb": 100.0 if name == "radius/torch" else 4.0,
        }
        for name, (fwds, trains) in times.items()
        for fwd, train in zip(fwds, trains, strict=True)
    ]
    return timing.timings_frame(rows, baseline="radius/torch")


def test_forward_numbers_of_chapter_5():
    table = timing_table(
        {
            "radius/torch": ([20.0, 20.0], [30.0, 30.0]),
            "radius/torch+compile": ([4.0, 4.0], [6.0, 6.0]),
            "radius/warp": ([0.5, 0.6], [2.0, 2.0]),
            "radius/warp+compile": ([1.0, 1.2], [3.0, 3.0]),
        }
    )
    numbers = wr.forward_numbers(table)
    assert set(numbers) == {"radius_warp_eager_speedup", "radius_mem_ratio"}
    assert numbers["radius_warp_eager_speedup"] == pytest.approx(20.0 / 0.55)
    assert numbers["radius_mem_ratio"] == 25.0
    assert all(type(v) is float for v in numbers.values())


def test_training_numbers_of_chapter_6():
    names = ["radius/warp", "radius/warp+compile", "radius/warp+reduce-overhead"]
    table = timing_table(
        {name: ([1.0, 1.0], [2.0 + i, 2.1 + i]) for i, name in enumerate(names)}
    )
    numbers = wr.training_numbers(table)
    assert set(numbers) == {"eager_train_ms", "adjoint_train_ms"}
    assert numbers["eager_train_ms"] == pytest.approx(2.05)
    assert numbers["adjoint_train_ms"] == pytest.approx(3.05)


def test_host_profiles_and_numbers_of_chapter_5():
    p_query, p_ref, _ = problem("cpu")
    prob = extkernels.problem()
    model = wr.warp_projector(prob)
    tables = wr.host_profiles(
        {"eager": model}, p_query, p_ref, device=torch.device("cpu"), n_iters=2
    )
    assert len(tables["eager"]) > 0
    numbers = wr.host_numbers(tables)
    assert set(numbers) == {"host_eager_ms"}
    assert numbers["host_eager_ms"] > 0


def test_warp_projector_is_seeded_and_takes_the_backends_options():
    prob = extkernels.problem()
    a, b = wr.warp_projector(prob), wr.warp_projector(prob, handover="saved")
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert b.aggregation.options == {"handover": "saved"}
    assert b.aggregation.backend == "warp"


def test_launch_and_deferred_numbers_of_chapter_7():
    cost = pd.Series(
        {
            "from_torch": 60.0,
            "from_torch(return_ctype=True)": 40.0,
            "tensor directly": 45.0,
            "recorded launch": 10.0,
        }
    )
    assert wi.launch_numbers(cost) == {"ctype_gain": 1.5, "record_gain": 4.0}
    deferred = pd.DataFrame(
        {"ms per step": [0.9, 0.3], "device kernels per step": [12.0, 8.0]},
        index=["SquaresNaive", "SquaresFixed"],
    )
    numbers = wi.deferred_numbers(deferred)
    assert numbers == {"deferred_gain": pytest.approx(3.0)}


def test_graph_numbers_of_chapter_7():
    table = timing_table(
        {
            "radius/warp": ([0.6, 0.6], [2.4, 2.5]),
            "radius/warp+1thread": ([0.5, 0.7], [1.6, 1.6]),
            "radius/warp+compile": ([0.8, 0.8], [2.7, 2.7]),
            "radius/warp+compile+1thread": ([0.6, 0.6], [2.6, 2.8]),
            "radius/warp+graphs": ([0.2, 0.2], [0.5, 0.5]),
        }
    )
    graphed = wi.graph_numbers(table)
    assert graphed == {"g_train_gain": pytest.approx(2.45 / 0.5)}


@pytest.mark.parametrize("device", DEVICES)
def test_chain_step_zeroes_and_repeats(device):
    x = torch.randn(64, device=device)
    y = torch.full_like(x, 5.0)
    step = wi.chain_step(x, y, 3)
    step()
    first = y.clone()
    step()
    torch.testing.assert_close(y, first)
    torch.testing.assert_close(
        first, wi.saxpy_chain(x, torch.zeros_like(x), 3, shared=True)
    )


def test_replay_matches_compares_with_the_eager_forward():
    prob = extkernels.problem()
    p_query, p_ref, _ = problem("cpu")
    model = wr.warp_projector(prob)
    with torch.no_grad():
        expected = model(p_query, p_ref)
    assert wi.replay_matches(lambda: expected.clone(), model, p_query, p_ref)
    assert not wi.replay_matches(lambda: expected + 1e-3, model, p_query, p_ref)


# Chapter 5's build-up (extkernels.experiments.warp_steps): every step is the radius
# aggregation, and each reason for the next step shows.


@pytest.mark.parametrize("device", DEVICES)
def test_every_step_of_the_build_up_is_the_radius_aggregation(device):
    from extkernels.experiments import warp_steps

    p_query, p_ref, feats = problem(device)
    expected = torch_backend.radius_aggregate(p_query, p_ref, feats, RADIUS, SIGMA)
    assert (expected[-1] == 0).all()  # the far query has no neighbour
    for name, step in warp_steps.steps(torch.device(device)).items():
        got = step(p_query, p_ref, feats, RADIUS, SIGMA)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_weights_relative_to_the_nearest_neighbour_survive_a_radius_of_many_sigmas(
    device,
):
    """At a radius of 250 sigma, exp(-d / sigma) underflows to 0 for every neighbour of
    a query whose nearest lies past about 100 sigma: the plain sum (step 2) returns
    zeros there, the shifted steps the brute force's output."""
    from extkernels.experiments import warp_steps

    radius, sigma = 0.5, 0.002
    p_ref = extkernels.reference_cloud(2000, seed=0).to(device)
    p_query = extkernels.query_grid(10).to(device)
    feats = extkernels.features(2000, 8, seed=0).to(device)
    steps = warp_steps.steps(torch.device(device))
    wrong = warp_steps.wrong_share(steps, (p_query, p_ref, feats, radius, sigma))
    assert list(wrong.index) == list(steps)
    assert wrong["hash grid"] > 0
    assert (wrong.drop("hash grid") == 0).all()


def test_the_steps_are_timed_in_order_against_the_step_before():
    from extkernels.experiments import warp_steps

    p_query, p_ref, feats = problem("cpu")
    funcs = dict(list(warp_steps.steps(torch.device("cpu")).items())[:2])
    table = warp_steps.time_steps(
        funcs, (p_query, p_ref, feats, RADIUS, SIGMA), n_iters=2, repeats=3
    )
    assert table.index.tolist() == list(funcs)
    assert (table["fastest"] <= table["ms per call"]).all()
    assert (table["ms per call"] <= table["slowest"]).all()
    ratio = table["× the step before"]
    assert ratio.isna().iloc[0]
    first, second = table["ms per call"]
    assert ratio.iloc[1] == pytest.approx(first / second)


def test_the_ladder_numbers_are_the_gains_the_chapter_quotes():
    from extkernels.experiments import warp_steps

    names = [
        "every point",
        "hash grid",
        "shifted, two walks",
        "online, one walk",
        "four features per thread",
    ]
    ms = [10.0, 1.0, 1.2, 0.5, 0.3]
    table = pd.DataFrame(
        {
            "ms per call": ms,
            "fastest": [m * 0.95 for m in ms],
            "slowest": [m * 1.05 for m in ms],
        },
        index=pd.Index(names, name="step"),
    )
    quoted = warp_steps.ladder_numbers(table)
    assert set(quoted) == {"steps_grid_gain", "steps_total_gain"}
    assert quoted["steps_grid_gain"] == pytest.approx(10.0)
    assert quoted["steps_total_gain"] == pytest.approx(10.0 / 0.3)
