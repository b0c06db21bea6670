"""Backends as plug-ins (ops.registry), the entry points (ops.dispatch) and the
validation contract (ops.checks): what holds for every backend, whatever it computes."""

import functools
import math
import threading
import time
from collections.abc import Callable

import pytest
import torch

import extkernels
from extkernels.ops import checks, registry
from extkernels.ops.torch import brute_force

OPS = ["knn", "knn_aggregate", "radius_aggregate"]


@pytest.fixture
def scratch_registry(monkeypatch):
    """Backends registered inside a test vanish after it."""
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))


def _inputs():
    return (
        extkernels.query_grid(3),
        extkernels.reference_cloud(50),
        extkernels.features(50, 4),
    )


@pytest.mark.parametrize("op", OPS)
def test_torch_backend_is_listed(op):
    assert "torch" in extkernels.backends(op)


def test_backends_of_unknown_op_raises():
    with pytest.raises(ValueError, match="^op_name:"):
        extkernels.backends("knn_aggregation")


@pytest.mark.parametrize("op", OPS)
def test_unknown_backend_is_rejected(op):
    p_query, p_ref, feats = _inputs()
    args = {"knn": (p_query, p_ref, 3)}.get(op, (p_query, p_ref, feats, 0.5, 0.1))
    if op == "knn_aggregate":
        args = (p_query, p_ref, feats, 3, 0.1)
    with pytest.raises(ValueError, match="^backend:"):
        getattr(extkernels, op)(*args, backend="no-such-backend")


def test_a_search_alone_makes_a_knn_aggregate(scratch_registry):
    # A new kNN backend writes only its search; the aggregation is derived from it.
    calls = []

    def search(p_query, p_ref, k):
        calls.append(k)
        return brute_force.knn(p_query, p_ref, k)

    registry.register(registry.Backend("mine", devices=("cpu",), knn=search))
    assert "mine" in extkernels.backends("knn_aggregate")
    assert "mine" not in extkernels.backends("radius_aggregate")
    p_query, p_ref, feats = _inputs()
    f = feats.clone().requires_grad_(True)
    out = extkernels.knn_aggregate(p_query, p_ref, f, 5, 0.1, backend="mine")
    out.sum().backward()
    expected = extkernels.knn_aggregate(p_query, p_ref, feats, 5, 0.1)
    torch.testing.assert_close(out, expected)
    assert calls == [5] and f.grad is not None and f.grad.abs().sum() > 0


def test_operators_must_name_operations():
    with pytest.raises(ValueError, match="^operators:"):
        registry.Backend("bad", knn=brute_force.knn, operators={"search": "x::y"})


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks what a machine without CUDA lists"
)
def test_cuda_only_backends_are_not_listed_without_cuda(scratch_registry):
    registry.register(
        registry.Backend("fake-cuda", devices=("cuda",), knn=brute_force.knn)
    )
    registry.register(
        registry.Backend("fake-cpu", devices=("cpu",), knn=brute_force.knn)
    )
    for op in ("knn", "knn_aggregate"):
        assert "fake-cuda" not in extkernels.backends(op)
        assert "fake-cpu" in extkernels.backends(op)
    cuda_only = {b.name for b in registry.registered() if "cpu" not in b.devices}
    assert not set(extkernels.backends("knn")) & cuda_only


def test_cuda_only_backend_refuses_cpu_tensors(scratch_registry):
    registry.register(
        registry.Backend("fake-cuda", devices=("cuda",), knn=brute_force.knn)
    )
    p_query, p_ref, _ = _inputs()
    with pytest.raises(ValueError, match="^backend: 'fake-cuda' runs on cuda"):
        extkernels.knn(p_query, p_ref, 3, backend="fake-cuda")


def test_unavailable_backend_is_not_listed_and_refuses_to_run(scratch_registry):
    registry.register(
        registry.Backend(
            "absent", devices=("cpu",), available=lambda: False, knn=brute_force.knn
        )
    )
    assert "absent" not in extkernels.backends("knn")
    p_query, p_ref, _ = _inputs()
    with pytest.raises(RuntimeError, match="^backend: 'absent' is not available"):
        extkernels.knn(p_query, p_ref, 3, backend="absent")


# ---------------------------------------------------------------- value checks


@pytest.fixture
def isfinite_calls(monkeypatch):
    calls = []
    real = torch.isfinite

    def counting(t):
        calls.append(tuple(t.shape))
        return real(t)

    monkeypatch.setattr(torch, "isfinite", counting)
    return calls


@pytest.mark.parametrize("backend", ["torch", "warp"])
def test_values_are_checked_once_per_call(backend, isfinite_calls):
    if backend not in extkernels.backends("radius_aggregate"):
        pytest.skip(f"{backend} cannot run here")
    p_query, p_ref, feats = _inputs()
    extkernels.radius_aggregate(p_query, p_ref, feats, 0.5, 0.1, backend=backend)
    assert isfinite_calls == [tuple(p_query.shape), tuple(p_ref.shape)]


def test_value_checks_can_be_switched_off(isfinite_calls):
    p_query, p_ref, feats = _inputs()
    with checks.value_checks(False):
        extkernels.knn_aggregate(p_query, p_ref, feats, 3, 0.1)
    assert isfinite_calls == []
    extkernels.knn_aggregate(p_query, p_ref, feats, 3, 0.1)
    assert len(isfinite_calls) == 2


@pytest.mark.parametrize("bad", ["p_query", "p_ref"])
def test_one_check_names_the_cloud_that_is_not_finite(bad):
    clouds = dict(zip(["p_query", "p_ref"], _inputs()[:2], strict=True))
    clouds[bad][2, 1] = math.nan
    with pytest.raises(ValueError, match=f"^{bad}: expected finite coordinates"):
        checks.check_knn(clouds["p_query"], clouds["p_ref"], 3)
    checks.check_knn(
        clouds["p_query"], clouds["p_ref"], 3, values=False
    )  # metadata only


def test_call_checked_skips_value_checks_on_its_own_thread_only():
    p_query, p_ref, _ = _inputs()
    bad = p_ref.clone()
    bad[0, 0] = math.inf
    seen = {}

    def other_thread():
        try:
            checks.check_knn(p_query, bad, 3)
        except ValueError as e:
            seen["other"] = str(e)

    def inner():
        checks.check_knn(p_query, bad, 3)  # trusted: the caller checked
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        return "ran"

    assert checks.call_checked(inner) == "ran"
    assert seen["other"].startswith("p_ref: expected finite")
    with pytest.raises(ValueError, match="^p_ref:"):  # and the flag is gone afterwards
        checks.check_knn(p_query, bad, 3)


def test_grad_out_contract():
    p_query, _, feats = _inputs()
    good = torch.zeros(p_query.shape[0], feats.shape[1])
    assert checks.check_grad_out(good, p_query, feats) is good
    for bad, error in [
        (good.double(), TypeError),
        (good[:, :-1].contiguous(), ValueError),
        (good.T.contiguous().T, ValueError),
        (good.to("meta"), ValueError),
        (good.numpy(), TypeError),
    ]:
        with pytest.raises(error, match="^grad_out:"):
            checks.check_grad_out(bad, p_query, feats)


def test_value_checks_nest_and_come_back_after_an_exception():
    with checks.value_checks(False):
        with checks.value_checks(True):
            assert checks.value_checks_on()
        assert not checks.value_checks_on()
        with pytest.raises(RuntimeError), checks.value_checks(True):
            raise RuntimeError("inside")
        assert not checks.value_checks_on()
    assert checks.value_checks_on()


def _nan_calls() -> list[tuple[str, Callable[[], object]]]:
    """Every CPU backend's knn, knn_aggregate and radius_aggregate, with a NaN point."""
    p_query, p_ref, feats = _inputs()
    p_ref[5, 2] = math.nan
    devices = {b.name: b.devices for b in registry.registered()}
    calls = []
    for op in registry.OPERATIONS:
        for name in extkernels.backends(op):
            if "cpu" not in devices[name]:
                continue
            args = {
                "knn": (p_query, p_ref, 3),
                "knn_aggregate": (p_query, p_ref, feats, 3, 0.1),
                "radius_aggregate": (p_query, p_ref, feats, 0.5, 0.1),
            }[op]
            fn = getattr(extkernels, op)
            call = functools.partial(fn, *args, backend=name)
            calls.append((f"{name} {op}", call))
    return calls


def test_another_threads_switch_leaves_every_backends_checks_on():
    calls = _nan_calls()
    assert {c.split()[0] for c, _ in calls} >= {"torch", "cpp", "fused", "warp"}
    for _, call in calls:  # built and warm before the race
        with pytest.raises(ValueError, match="^p_ref: expected finite"):
            call()
    stop = threading.Event()

    def toggler():
        while not stop.is_set():
            with checks.value_checks(False):
                time.sleep(0)

    other = threading.Thread(target=toggler)
    other.start()
    accepted = []
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            for name, call in calls:
                try:
                    call()
                    accepted.append(name)
                except ValueError:
                    pass
    finally:
        stop.set()
        other.join()
    assert not accepted, (
        f"NaN points accepted while another thread switched: {accepted}"
    )
    assert checks.value_checks_on()


# ---------------------------------------------------------------- what a record carries


def test_every_backend_states_its_toolchain():
    from extkernels import guide

    for b in registry.registered():
        assert b.toolchain, f"{b.name}: Backend(toolchain=...) is empty"
        assert guide.toolchain(b.name) == b.toolchain


def test_the_guide_prints_each_toolchain_as_the_results_page_shows_it():
    from pathlib import Path

    from extkernels import guide

    page = (Path(__file__).resolve().parents[1] / "book" / "results.ipynb").read_text()
    for backend in {b for b, _ in guide.advice()}:
        assert registry.get(backend).toolchain in page, backend


def test_a_backend_without_a_toolchain_is_named_by_the_guide(scratch_registry):
    from extkernels import guide

    registry.register(registry.Backend("bare", devices=("cpu",), knn=brute_force.knn))
    with pytest.raises(ValueError, match="^backend: 'bare' registers no toolchain"):
        guide.toolchain("bare")
    with pytest.raises(ValueError, match="^name: expected one of"):
        guide.toolchain("no-such-backend")


def test_every_backend_is_benchmarked_or_says_why_not():
    from extkernels.variants import FLOOR, VARIANTS

    measured = {v.backend for v in VARIANTS}
    for b in registry.registered():
        if b.not_benchmarked is None:
            assert b.name in measured, (
                f"{b.name}: no variant in extkernels.variants.VARIANTS; add one, or "
                "say why not (Backend(not_benchmarked=...))"
            )
        else:
            assert b.name not in measured, (
                f"{b.name}: has variants, yet says it is not benchmarked"
            )
    names = {b.name for b in registry.registered()} | {FLOOR}
    assert measured <= names, f"variants of no backend: {measured - names}"


def test_a_scratch_registry_keeps_its_backends_to_itself():
    before = [b.name for b in registry.registered()]
    mine = registry.Backend("mine", devices=("cpu",), knn=brute_force.knn)
    with registry.scratch(mine, alone=True):
        assert [b.name for b in registry.registered()] == ["mine"]
        assert registry.get("mine") is mine
    with registry.scratch(mine):
        assert [b.name for b in registry.registered()] == [*before, "mine"]
        registry.register(registry.Backend("other", knn=brute_force.knn))
    assert [b.name for b in registry.registered()] == before
    with pytest.raises(ValueError, match="^name: expected one of"):
        registry.get("mine")


def test_registrations_wait_for_their_library_and_are_made_once():
    from extkernels.ops.onload import OnLoad

    made = []
    on_load = OnLoad()
    on_load(lambda: made.append("declared before the load"))
    assert made == [] and not on_load.loaded
    on_load.run()
    on_load.run()  # a second load() makes nothing again
    assert made == ["declared before the load"] and on_load.loaded
    on_load(lambda: made.append("declared after"))  # made at once
    assert made == ["declared before the load", "declared after"]
