"""extkernels.variants and extkernels.benchmark: the variants, run_all and merge."""

import json
import math

import pytest
import torch

import extkernels
from extkernels import benchmark
from extkernels import variants as V


def test_variant_names_are_unique():
    names = [v.name for v in V.VARIANTS]
    assert len(names) == len(set(names))


def test_get_finds_a_variant_by_name():
    for v in V.VARIANTS:
        assert V.get(v.name) is v


def test_get_unknown_variant_raises():
    with pytest.raises(ValueError, match="^name:"):
        V.get("knn/no-such-backend")


def test_every_variant_has_an_eager_torch_baseline():
    names = {v.name for v in V.VARIANTS}
    assert all(V.baseline_of(v) in names for v in V.VARIANTS)


def test_the_one_graph_variants_compile_with_inductors_one_graph_settings(
    small_problem, monkeypatch
):
    given = {}

    def compile(model, **kwargs):
        given.update(kwargs)
        return model

    monkeypatch.setattr(torch, "compile", compile)
    for name in ("knn/fused+compile+graphs", "radius/fused+compile+graphs"):
        given.clear()
        V.get(name).build(small_problem)
        assert given["options"] == V.IN_ONE_GRAPH == {"pattern_matcher": False}
    given.clear()
    V.get("knn/fused+compile+graphs+inductor-defaults").build(small_problem)
    assert given == {"fullgraph": True, "mode": None}  # inductor's defaults


def test_a_floor_variant_projects_through_a_fixed_gather(small_problem):
    model, _, (p_query, p_ref, _) = V.get("knn/floor").build(small_problem)
    assert isinstance(model.aggregation, extkernels.FixedGather)
    assert model.aggregation.index.max() < p_ref.shape[0]
    assert model(p_query, p_ref).shape == (p_query.shape[0], 1)
    assert V.get("knn/floor").available()


@pytest.mark.parametrize(
    "name", ["knn/fused+graphs@panda", "radius/fused+graphs@outlier"]
)
def test_a_variant_on_another_cloud_builds_that_cloud_and_its_queries(
    name, small_problem
):
    from extkernels import clouds

    v = V.get(name)
    _, _, (p_query, p_ref, target) = v.build(small_problem)
    w = clouds.workload(
        v.cloud,
        small_problem.cloud_size(v.workload),
        side=small_problem.grid_side,
        seed=small_problem.seed,
    )
    assert torch.equal(p_ref.cpu(), w.p_ref) and torch.equal(p_query.cpu(), w.p_query)
    assert target.shape[0] == p_query.shape[0]


@pytest.mark.parametrize("name", ["knn/torch", "radius/torch", "knn/floor"])
def test_run_eager_variant_at_a_tiny_problem(name, small_problem):
    row = V.run(V.get(name), small_problem)
    assert row["variant"] == name
    assert row["workload"] == name.split("/")[0]
    for key in ("forward_ms", "train_ms", "first_call_s"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert row["n_ref"] == 300
    assert row["n_query"] == 4**3


def test_run_all_computes_speedups_per_workload(monkeypatch):
    times = {
        "knn/torch": 10.0,
        "knn/torch+compile": 2.0,
        "radius/torch": 30.0,
        "radius/torch+compile": 60.0,
    }

    def fake_run(variant, prob):
        ms = times[variant.name]
        return {
            "variant": variant.name,
            "workload": variant.workload,
            "forward_ms": ms,
            "train_ms": 2 * ms,
        }

    monkeypatch.setattr(V, "run", fake_run)
    df = benchmark.run_all(list(times))
    assert df["forward_speedup"].to_dict() == {
        "knn/torch": 1.0,
        "knn/torch+compile": 5.0,
        "radius/torch": 1.0,
        "radius/torch+compile": 0.5,
    }
    assert df["train_speedup"].to_dict() == df["forward_speedup"].to_dict()


def test_variant_without_backward_thread_is_timed_with_autograd_multithreading_off(
    monkeypatch, small_problem
):
    seen = []
    real = V.time_projector

    def spy(*args, **kwargs):
        seen.append(torch._C._is_multithreading_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(V, "time_projector", spy)
    V.run(V.get("radius/warp+1thread"), small_problem)
    V.run(V.get("radius/warp"), small_problem)
    assert seen == [False, True]
    assert torch._C._is_multithreading_enabled()  # restored afterwards


def test_run_all_fresh_runs_every_variant_in_its_own_process(monkeypatch):
    in_process, own_process = [], []

    def fake_run(variant, prob):
        in_process.append(variant.name)
        return {
            "variant": variant.name,
            "workload": variant.workload,
            "forward_ms": 1.0,
            "train_ms": 1.0,
        }

    def fake_isolated(name, *, cold=True, caches=None):
        own_process.append(name)
        return [
            {
                "variant": name,
                "workload": name.split("/")[0],
                "forward_ms": 2.0,
                "train_ms": 2.0,
            }
        ]

    monkeypatch.setattr(V, "run", fake_run)
    monkeypatch.setattr(benchmark, "_run_isolated", fake_isolated)
    names = ["radius/torch", "radius/warp"]
    df = benchmark.run_all(names, fresh=True, verbose=False)
    assert own_process == names and in_process == []
    assert df["forward_ms"].to_dict() == {"radius/torch": 2.0, "radius/warp": 2.0}
    benchmark.run_all(names, verbose=False)
    assert in_process == names


def test_run_all_repeats_every_variant_in_fresh_processes_cold_first(monkeypatch):
    calls = []

    def fake_isolated(name, *, cold=True, caches=None):
        calls.append((name, cold))
        ms = 1.0 + sum(c[0] == name for c in calls)  # 2, 3, 4 ms for runs 1, 2, 3
        return [
            {
                "variant": name,
                "workload": "radius",
                "forward_ms": ms,
                "train_ms": 2 * ms,
            }
        ]

    monkeypatch.setattr(benchmark, "_run_isolated", fake_isolated)
    names = ["radius/torch", "radius/warp"]
    df = benchmark.run_all(names, repeats=3, verbose=False)
    assert calls == [(n, cold) for n in names for cold in (True, False, False)]
    assert df.loc[
        "radius/warp", ["forward_ms", "forward_min", "forward_max", "repeats"]
    ].tolist() == [
        3.0,
        2.0,
        4.0,
        3,
    ]
    assert len(df.attrs["runs"]) == 6
    with pytest.raises(ValueError, match="^repeats:"):
        benchmark.run_all(names, repeats=0, verbose=False)


def _benchmark_file(path, hardware, runs, versions=None):
    runs = [
        {"variant": v, "workload": v.split("/")[0], "forward_ms": f, "train_ms": 2 * f}
        for v, f in runs
    ]
    meta = {"hardware": hardware, "date": "today", "versions": versions or {}}
    path.write_text(json.dumps({"meta": meta, "rows": [], "runs": runs}))
    return str(path)


def test_benchmark_merge_refuses_files_of_two_machines(tmp_path):
    paths = [
        _benchmark_file(tmp_path / f"{hw}.json", hw, [("knn/torch", 1.0)])
        for hw in ("GPU A", "GPU B")
    ]
    meta, df = benchmark.merge(paths[:1] * 2)
    assert meta["date"] == "today"  # each date once
    with pytest.raises(ValueError, match="^paths: expected files from one kind of GPU"):
        benchmark.merge(paths)


def test_benchmark_merge_replaces_the_runs_of_a_variant_timed_again(tmp_path):
    old = [("knn/torch", 10.0), ("knn/torch", 11.0), ("knn/cpp", 1.0), ("knn/cpp", 1.2)]
    first = _benchmark_file(tmp_path / "old.json", "GPU", old)
    again = _benchmark_file(tmp_path / "new.json", "GPU", [("knn/cpp", 0.5)])
    _, df = benchmark.merge([first, again])
    assert df.loc["knn/cpp", "repeats"] == 1
    assert df.loc["knn/cpp", "forward_ms"] == 0.5  # the old runs are gone
    assert df.loc["knn/torch", "repeats"] == 2  # a variant not timed again stays


def test_benchmark_merge_lists_every_value_of_a_component_that_differs(tmp_path):
    a = {"torch": "2.13.0", "host CPU": "CPU A (16 cores)"}
    b = {"torch": "2.13.0", "host CPU": "CPU B (16 cores)", "driver": "580"}
    paths = [
        _benchmark_file(tmp_path / f"{i}.json", "GPU", [(v, 1.0)], versions)
        for i, (v, versions) in enumerate([("knn/torch", a), ("knn/cpp", b)])
    ]
    meta, _ = benchmark.merge(paths)
    assert meta["versions"]["torch"] == "2.13.0"  # the same in both: once
    assert meta["versions"]["host CPU"] == "CPU A (16 cores); CPU B (16 cores)"
    assert meta["versions"]["driver"] == "not recorded; 580"  # none in the first


def test_a_variant_that_fails_in_its_process_reports_its_error():
    with pytest.raises(RuntimeError, match="no/such-variant") as failure:
        benchmark._run_isolated("no/such-variant")
    assert "Traceback" in str(failure.value)  # the child's stderr, kept for the reader


def test_every_variant_names_its_chapter():
    chapters = V.chapters()
    assert set(chapters) == {v.name for v in V.VARIANTS}
    assert chapters["knn/torch"] == 1 and chapters["knn/cuml"] == 3
