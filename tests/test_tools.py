"""Timing, profiling, variants, the benchmark and execute commands, and notebook
helpers."""

import json
import math
import os
from pathlib import Path

import pandas as pd
import pytest
import torch

import extkernels
from extkernels import benchmark, notebook, profiling, results, timing
from extkernels import variants as V

CPU = torch.device("cpu")


# ---------------------------------------------------------------- timing


@pytest.fixture
def tiny_projector_timing():
    torch.manual_seed(0)
    model = extkernels.Projector(extkernels.KnnAggregation(k=4, sigma=0.1), hidden=8)
    p_ref = extkernels.reference_cloud(100)
    p_query = extkernels.query_grid(3)
    target = extkernels.targets(p_query.shape[0])
    return timing.time_projector(model, p_query, p_ref, target, n_warmup=1, n_iters=2)


def test_time_projector_gives_positive_finite_times(tiny_projector_timing):
    for key in ("forward_ms", "train_ms"):
        value = tiny_projector_timing[key]
        assert math.isfinite(value) and value > 0, key


def test_time_projector_peak_memory_is_nan_on_the_cpu(tiny_projector_timing):
    assert math.isnan(tiny_projector_timing["peak_mb"])


def test_time_fn_measures_milliseconds_per_call():
    import time

    ms = timing.time_fn(lambda: time.sleep(0.005), 3)
    assert 4.5 <= ms < 100


def test_time_blocks_gives_the_median_block_between_the_fastest_and_slowest():
    import time

    calls = []

    def fn():  # every call sleeps longer than the last: later blocks are slower
        calls.append(None)
        time.sleep(0.0005 * len(calls))

    median, fastest, slowest = timing.time_blocks(fn, 3, repeats=3)
    assert fastest < median < slowest


def _rows():
    nan = math.nan
    return [
        timing.Timing(
            "base",
            forward_ms=10.0,
            train_ms=40.0,
            peak_mb=nan,
            hardware="CPU",
            n_ref=1,
            n_query=1,
        ),
        timing.Timing(
            "fast",
            forward_ms=2.5,
            train_ms=10.0,
            peak_mb=nan,
            hardware="CPU",
            n_ref=1,
            n_query=1,
        ),
        {
            "variant": "slow",
            "forward_ms": 20.0,
            "train_ms": 80.0,
            "peak_mb": nan,
            "hardware": "CPU",
            "n_ref": 1,
            "n_query": 1,
        },
    ]


def test_timings_frame_forward_speedups_over_the_baseline():
    df = timing.timings_frame(_rows(), baseline="base")
    assert df["forward_speedup"].to_dict() == {"base": 1.0, "fast": 4.0, "slow": 0.5}


def test_timings_frame_train_speedups_over_the_baseline():
    df = timing.timings_frame(_rows(), baseline="base")
    assert df["train_speedup"].to_dict() == {"base": 1.0, "fast": 4.0, "slow": 0.5}


def test_timings_frame_is_indexed_by_variant():
    df = timing.timings_frame(_rows())
    assert list(df.index) == ["base", "fast", "slow"]
    assert df.loc["fast", "forward_ms"] == 2.5


def test_timings_frame_reports_median_and_spread_of_repeated_runs():
    rows = [
        {
            "variant": "v",
            "forward_ms": f,
            "train_ms": t,
            "first_call_s": c,
            "hardware": "CPU",
        }
        for f, t, c in [(3.0, 30.0, 9.0), (1.0, 10.0, math.nan), (2.0, 50.0, math.nan)]
    ] + [
        {
            "variant": "w",
            "forward_ms": 4.0,
            "train_ms": 8.0,
            "first_call_s": 1.0,
            "hardware": "CPU",
        }
    ]
    df = timing.timings_frame(rows, baseline="v")
    v = df.loc["v"]
    assert (v.forward_ms, v.forward_min, v.forward_max) == (2.0, 1.0, 3.0)
    assert (v.train_ms, v.train_min, v.train_max) == (30.0, 10.0, 50.0)
    assert (v.repeats, v.first_call_s, v.hardware) == (3, 9.0, "CPU")
    assert df.loc["w", "forward_speedup"] == 0.5  # ratios of medians
    assert (df.loc["w", "forward_min"], df.loc["w", "repeats"]) == (4.0, 1)


@pytest.mark.parametrize("baseline", [None, "missing"])
def test_timings_frame_without_a_present_baseline_has_no_speedups(baseline):
    df = timing.timings_frame(_rows(), baseline=baseline)
    assert "forward_speedup" not in df and "train_speedup" not in df


# ---------------------------------------------------------------- profiling


@pytest.fixture(scope="module")
def knn_kernels():
    p_ref = extkernels.reference_cloud(500)
    p_query = extkernels.query_grid(6)
    prof = profiling.profile(
        lambda: extkernels.knn(p_query, p_ref, 7), device=CPU, n_iters=2
    )
    return profiling.top_kernels(prof)


def test_top_kernels_columns(knn_kernels):
    assert list(knn_kernels.columns) == [
        "name",
        "time (ms)",
        "share (%)",
        "calls",
        "memory (MiB)",
    ]


def test_top_kernels_is_not_empty_and_capped(knn_kernels):
    assert 0 < len(knn_kernels) <= 8


def test_top_kernels_shares_sum_to_at_most_100(knn_kernels):
    assert knn_kernels["share (%)"].sum() <= 100 + 0.01
    assert (knn_kernels["share (%)"] > 0).all()


def test_top_kernels_sorted_by_time_descending(knn_kernels):
    times = knn_kernels["time (ms)"].tolist()
    assert times == sorted(times, reverse=True)


def test_top_kernels_show_topk(knn_kernels):
    assert knn_kernels["name"].str.contains("topk").any()


def test_top_kernels_counts_calls_per_iteration():
    p_ref = extkernels.reference_cloud(50)
    p_query = extkernels.query_grid(3)
    prof = profiling.profile(
        lambda: extkernels.knn(p_query, p_ref, 3), device=CPU, n_iters=3
    )
    df = profiling.top_kernels(prof, top=50)
    assert df.loc[df["name"] == "aten::topk", "calls"].tolist() == [1]


def test_stacked_keeps_the_columns_and_puts_each_table_under_its_title(knn_kernels):
    table = profiling.stacked({"eager": knn_kernels, "other": knn_kernels.head(2)})
    assert list(table.columns) == list(knn_kernels.columns)
    assert list(table.index.get_level_values(0).unique()) == ["eager", "other"]
    assert len(table.loc["other"]) == 2 and len(table) == len(knn_kernels) + 2


# ---------------------------------------------------------------- variants


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


# ---------------------------------------------------------------- notebook helpers


def test_versions_is_indexed_by_component():
    df = notebook.versions()
    assert isinstance(df, pd.DataFrame)
    assert df.index.name == "component"
    assert {"torch", "device", "python"} <= set(df.index)


def test_versions_reports_the_running_torch():
    assert notebook.versions().loc["torch", "version"] == torch.__version__


def test_versions_names_the_host_cpu_and_its_cores():
    host = notebook.versions().loc["host CPU", "version"]
    assert host.endswith(f"({os.cpu_count()} cores)")
    assert len(host) > len(f" ({os.cpu_count()} cores)")


def test_versions_names_the_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert notebook.versions().loc["device", "version"].startswith("CPU")


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


# ---------------------------------------------------------------- results page


def test_results_tables_from_a_benchmark_file(tmp_path):
    from extkernels import results

    rows = [
        {
            "variant": "knn/torch",
            "forward_ms": 80.0,
            "forward_min": 79.0,
            "forward_max": 82.5,
            "train_ms": 81.0,
            "train_min": 80.0,
            "train_max": 90.0,
            "forward_speedup": 1.0,
            "train_speedup": 1.0,
            "peak_mb": 41000.4,
        },
        {
            "variant": "knn/new",
            "forward_ms": 0.2,
            "forward_min": 0.19,
            "forward_max": 0.21,
            "train_ms": 0.5,
            "train_min": 0.45,
            "train_max": 0.6,
            "forward_speedup": 400.0,
            "train_speedup": 162.0,
            "peak_mb": 50.0,
        },
    ]
    path = tmp_path / "bench.json"
    path.write_text(
        json.dumps({"meta": {"hardware": "GPU X", "repeats": 5}, "rows": rows})
    )
    meta, df = results.load(path)
    assert meta["hardware"] == "GPU X" and list(df.index) == ["knn/torch", "knn/new"]
    book = results.book_table(df, {"knn/torch": 1})
    assert book.loc["knn/torch", "forward ms"] == "80.000 (79.000–82.500)"
    assert (book.loc["knn/torch", "chapter"], book.loc["knn/new", "chapter"]) == (1, "")
    anchor = results.anchor_table(df)
    from extkernels.reference import ANCHOR_A100

    assert anchor.loc["knn/torch", ANCHOR_A100] == "144.0 / 144.8"
    # the anchor's compiled pair: compiled forward and compiled training step
    assert anchor.loc["knn/cuml-op+compile+rmm", ANCHOR_A100] == "11.2 / 12.6"
    assert anchor.loc["knn/torch", "this book (median)"] == "80 / 81"
    assert (
        anchor.loc["radius/warp+compile", "this book (median)"] == ""
    )  # not in this file
    merged = "2026-01-02T11:27:44+00:00, 2026-01-02T09:03:13+00:00"
    assert results.measured({"date": merged}) == "2026-01-02 09:03 to 2026-01-02 11:27"
    assert results.measured({"date": "2026-01-02T09:03:13+00:00"}) == "2026-01-02 09:03"


def test_summary_is_narrow_and_says_median_and_range():
    rows = [
        {
            "variant": "v",
            "forward_ms": f,
            "train_ms": 2 * f,
            "peak_mb": 10.0,
            "hardware": "CPU",
        }
        for f in (1.0, 2.0, 4.0)
    ]
    out = timing.summary(timing.timings_frame(rows))
    assert list(out.columns) == ["forward ms", "training ms", "peak MiB"]
    assert out.loc["v", "forward ms"] == "2.000 (1.000–4.000)"
    assert out.loc["v", "training ms"] == "4.000 (2.000–8.000)"


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
    assert meta["date"] == "today, today"
    with pytest.raises(ValueError, match="^paths: expected files from one machine"):
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
    assert meta["versions"]["driver"] == "580"


@pytest.mark.parametrize(
    "b_runs, expected",
    [((3.0, 4.0), "faster than"), ((0.1, 0.5), "slower than"), ((1.5, 9.0), "within")],
)
def test_verdict_claims_a_difference_only_when_the_ranges_do_not_overlap(
    b_runs, expected
):
    rows = [{"variant": "a", "forward_ms": f, "train_ms": f} for f in (1.0, 2.0)]
    rows += [{"variant": "b", "forward_ms": f, "train_ms": f} for f in b_runs]
    assert timing.verdict(timing.timings_frame(rows), "a", "b").startswith(expected)


@pytest.mark.gpu
def test_device_quantiles_leave_the_host_out():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import time

    x = torch.randn(1024, device="cuda")

    def fn():  # a host that takes 2 ms to launch a tiny kernel
        time.sleep(0.002)
        return x + 1

    low, median, high = timing.device_quantiles(fn)
    assert 0 < low <= median <= high < 1.0, (low, median, high)


@pytest.mark.gpu
def test_top_kernels_on_the_host_show_the_compiled_wrapper():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = torch.randn(1024, device="cuda")
    fn = torch.compile(lambda t: (t * 2).sin())
    prof = profiling.profile(lambda: fn(x), device=torch.device("cuda"), n_iters=3)
    host = profiling.top_kernels(prof, top=50, host=True)["name"]
    device = profiling.top_kernels(prof, top=50)["name"]
    # The generated kernel runs on the device; the wrapper of the region on the host.
    assert host.str.contains("Compiled|compiled", regex=True).any(), host.tolist()
    assert not device.str.contains("Torch-Compiled Region").any(), device.tolist()


def test_a_variant_that_fails_in_its_process_reports_its_error():
    with pytest.raises(RuntimeError, match="no/such-variant") as failure:
        benchmark._run_isolated("no/such-variant")
    assert "Traceback" in str(failure.value)  # the child's stderr, kept for the reader


def _frame(ms: dict[str, tuple[float, float]]):
    return timing.timings_frame(
        [{"variant": v, "forward_ms": f, "train_ms": t} for v, (f, t) in ms.items()]
    )


def test_above_floor_subtracts_the_floor_per_metric():
    df = _frame({"x": (0.5, 2.0), "floor": (0.3, 1.5)})
    out = timing.above_floor(df, {"eager": ("x", "floor")})
    assert out.loc[("eager", "forward"), "aggregation ms"] == pytest.approx(0.2)
    assert out.loc[("eager", "training"), "aggregation ms"] == pytest.approx(0.5)
    assert out.loc[("eager", "training"), "floor ms"] == pytest.approx(1.5)


def test_timing_panels_draws_a_panel_per_workload_with_every_variant():
    import matplotlib

    matplotlib.use("Agg")
    from extkernels import plotting

    def frame(names):
        return pd.DataFrame(
            {"forward_ms": [1.0, 2.0, 3.0][: len(names)], "train_ms": 2.0},
            index=names,
        )

    parts = {"kNN": frame(["knn/a", "knn/b", "knn/c"]), "radius": frame(["radius/a"])}
    fig = plotting.timing_panels(parts, title="every variant", hardware="NVIDIA X")
    assert [ax.get_title(loc="left") for ax in fig.axes] == ["kNN", "radius"]
    labels = [[t.get_text() for t in ax.get_yticklabels()] for ax in fig.axes]
    assert labels == [["knn/a", "knn/b", "knn/c"], ["radius/a"]]
    assert "NVIDIA X" in fig._suptitle.get_text()
    assert len(fig.axes[0].patches) == 6  # a forward and a training bar per variant


def test_timing_bars_label_each_median_alike_and_keep_the_legend_by_the_axes():
    import matplotlib

    matplotlib.use("Agg")
    from extkernels import plotting

    df = pd.DataFrame(
        {"forward_ms": [0.0709, 3.2], "train_ms": [87.94, 144.0]},
        index=["knn/a", "knn/b"],
    )
    fig = plotting.timing_bars(df, title="t", hardware="NVIDIA X", log=True)
    (ax,) = fig.axes
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels == sorted(["0.071", "3.20", "87.9", "144"])
    # the log axis's labels are plain numbers, and none of them on a minor tick
    fig.canvas.draw()
    ticks = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert ticks and all("10^" not in t and "$" not in t for t in ticks)
    assert not [t for t in ax.get_xticklabels(minor=True) if t.get_text()]
    # the legend sits just under the axes, not at the figure's far foot
    legend = fig.legends[0].get_window_extent()
    axes = ax.get_tightbbox()
    assert 0 <= axes.y0 - legend.y1 < 0.05 * fig.bbox.height


def test_timing_panels_legend_covers_no_panel_or_title():
    import matplotlib

    matplotlib.use("Agg")
    from extkernels import plotting

    long = "knn/cuml-op+compile+rmm-rapids"  # a long name narrows the axes
    df = pd.DataFrame({"forward_ms": [1.0, 2.0], "train_ms": [2.0, 3.0]}, [long, "k/b"])
    fig = plotting.timing_panels(
        {"kNN projector": df, "radius projector": df}, title="t", hardware="NVIDIA X"
    )
    fig.canvas.draw()
    legend = fig.legends[0].get_window_extent()
    for ax in fig.axes:
        for box in (ax.get_window_extent(), ax.title.get_window_extent()):
            assert not legend.overlaps(box), (legend, box)
    assert not legend.overlaps(fig._suptitle.get_window_extent())


def test_range_bars_draws_a_panel_per_group_with_its_whiskers():
    import matplotlib

    matplotlib.use("Agg")
    from extkernels import plotting

    index = pd.MultiIndex.from_tuples(
        [
            ("F = 25", "gather", "C++"),
            ("F = 25", "gather", "PTX"),
            ("F = 32", "scatter", "C++"),
        ],
        names=["features", "piece", "written in"],
    )
    df = pd.DataFrame(
        {"us": [13.6, 9.5, 20.3], "p20": [13.0, 9.4, 19.6], "p80": [13.9, 10.7, 21.1]},
        index=index,
    )
    fig = plotting.range_bars(
        df,
        value="us",
        low="p20",
        high="p80",
        title="t",
        hardware="NVIDIA X",
        xlabel="µs per call",
        by=["features", "piece"],
    )
    assert [ax.get_title(loc="left") for ax in fig.axes] == [
        "F = 25 · gather",
        "F = 32 · scatter",
    ]
    labels = [[t.get_text() for t in ax.get_yticklabels()] for ax in fig.axes]
    assert labels == [["C++", "PTX"], ["C++"]]
    assert sorted(t.get_text() for ax in fig.axes for t in ax.texts) == sorted(
        ["13.6", "9.50", "20.3"]
    )
    # each whisker spans low to high
    bars = next(c for c in fig.axes[0].containers if hasattr(c, "errorbar"))
    (_, caps, _) = bars.errorbar.lines
    ends = sorted(x for cap in caps for x in cap.get_xdata())
    assert ends == pytest.approx(sorted([13.0, 13.9, 9.4, 10.7]))
    assert fig.axes[-1].get_xlabel() == "µs per call"


def test_clouds_table_sets_each_cloud_beside_the_books_cloud():
    from extkernels import results

    df = pd.DataFrame(
        {"forward_ms": [0.2, 0.3, 0.1, 1.0], "train_ms": [0.5, 0.6, 0.3, 2.0]},
        index=["knn/a", "knn/a@panda", "radius/b", "knn/alone"],
    )
    t = results.clouds_table(df)
    assert list(t.index) == [("knn/a", "normal"), ("knn/a", "panda")]
    assert t.loc[("knn/a", "panda"), "forward / normal"] == pytest.approx(1.5)
    assert t.loc[("knn/a", "panda"), "train / normal"] == pytest.approx(1.2)


def test_summary_says_n_a_where_there_is_no_peak_memory():
    rows = [
        {
            "variant": v,
            "forward_ms": 1.0,
            "train_ms": 2.0,
            "peak_mb": p,
            "hardware": "x",
        }
        for v, p in (("a", 12.4), ("b", float("nan")))
    ]
    out = timing.summary(timing.timings_frame(rows))
    assert out["peak MiB"].tolist() == ["12", "n/a"]


def test_floors_are_shown_without_speedups():
    df = pd.DataFrame(
        {
            "forward_ms": [2.0, 1.0],
            "forward_min": [2.0, 1.0],
            "forward_max": [2.0, 1.0],
            "train_ms": [4.0, 2.0],
            "train_min": [4.0, 2.0],
            "train_max": [4.0, 2.0],
            "forward_speedup": [5.0, 10.0],
            "train_speedup": [5.0, 10.0],
            "peak_mb": [1.0, 1.0],
        },
        index=pd.Index(["knn/cpp", "knn/floor"], name="variant"),
    )
    out = results.book_table(df, {"knn/cpp": 9, "knn/floor": 9})
    assert out.loc["knn/cpp", "× eager fwd"] == 5.0
    assert out.loc["knn/floor", "× eager fwd"] == ""
    assert results.is_floor(df).tolist() == [False, True]
    floors = results.floors_table(df, {"knn/floor": 9})
    assert floors.index.tolist() == ["knn/floor"]
    assert "× eager fwd" not in floors and floors.loc["knn/floor", "chapter"] == 9


def test_ranked_lists_knn_then_radius_by_training_step_without_floors():
    df = pd.DataFrame(
        {"train_ms": [3.0, 0.5, 1.0, 2.0, 0.1]},
        index=["radius/warp", "radius/fused", "knn/cpp", "knn/torch", "knn/floor"],
    )
    order = results.ranked(df).index.tolist()
    assert order == ["knn/cpp", "knn/torch", "radius/fused", "radius/warp"]
    parts = results.by_workload(df)
    assert list(parts) == ["kNN projector", "radius projector"]
    assert parts["kNN projector"].index.tolist() == [
        "knn/floor",
        "knn/cpp",
        "knn/torch",
    ]
    assert parts["radius projector"].index.tolist() == ["radius/fused", "radius/warp"]
    unsorted = results.by_workload(df, sort=False)["kNN projector"].index.tolist()
    assert unsorted == ["knn/cpp", "knn/torch", "knn/floor"]


def test_every_variant_names_its_chapter():
    chapters = V.chapters()
    assert set(chapters) == {v.name for v in V.VARIANTS}
    assert chapters["knn/torch"] == 1 and chapters["knn/cuml"] == 3


def test_the_guide_reads_every_number_from_the_measurements():
    """Each row's numbers come from the committed files: changing a measurement
    changes the guide."""
    from extkernels import guide
    from extkernels.experiments import geometry

    data = Path(__file__).parents[1] / "book" / "data"
    _, bench = results.load(data / "benchmark-h200.json")
    _, clouds = results.load(data / "benchmark-clouds-h200.json")
    _, times, _ = geometry.load(data / "geometry-h200.json")
    table = guide.guide(bench, clouds, times)
    assert table.notna().all().all() and len(table) == 7
    before = table.loc["kNN in a training loop, any cloud", "on the book's cloud"]
    bench.loc["knn/fused+graphs", "train_ms"] = 123.0
    after = guide.guide(bench, clouds, times)
    assert (
        before != after.loc["kNN in a training loop, any cloud", "on the book's cloud"]
    )
    assert (
        "123.000 ms"
        in after.loc["kNN in a training loop, any cloud", "on the book's cloud"]
    )
    assert guide.source_lines("torch") > 0
    assert guide.source_lines("fused") > guide.source_lines("torch")


def test_the_guide_gives_the_warm_first_call_where_the_benchmark_measured_it():
    from extkernels import guide
    from extkernels.experiments import geometry

    data = Path(__file__).parents[1] / "book" / "data"
    _, bench = results.load(data / "benchmark-h200.json")
    _, clouds = results.load(data / "benchmark-clouds-h200.json")
    _, times, _ = geometry.load(data / "geometry-h200.json")
    # chapter 14's file gives the blob row its first call: neither file has a warm one
    bench = bench.drop(columns="warm_first_call_s", errors="ignore")
    clouds = clouds.drop(columns="warm_first_call_s", errors="ignore")
    cold = guide.guide(bench, clouds, times).to_string()
    assert "first call of a new process" in cold and "caches warm" not in cold
    bench["warm_first_call_s"] = 0.25
    warm = guide.guide(bench, clouds, times).to_string()
    assert "(0.2 s with the compilers' caches warm)" in warm


def test_the_answer_reads_the_fastest_steps_from_the_files():
    data = Path(__file__).parents[1] / "book" / "data"
    _, bench = results.load(data / "benchmark-h200.json")
    q = results.variant_quotes(results.by_workload(bench))
    exact = bench[~results.is_floor(bench)]
    knn = exact[exact.index.str.startswith("knn/")].sort_values("train_ms")
    best = knn.index[0]
    # the runner-up is another projector, not the fastest with a setting changed
    others = [v for v in knn.index[1:] if not v.startswith(f"{best}+")]
    assert q["knn_best"] == best and q["knn_runner_up"] == others[0]
    assert q["knn_best_train"] == knn["train_ms"].iloc[0]
    assert "floor" not in q["radius_best"]
    bench.loc["knn/cuml", ["train_ms", "train_min", "train_max"]] = 0.001
    assert results.variant_quotes(results.by_workload(bench))["knn_best"] == "knn/cuml"


def _broken(x):
    x = x + 1
    torch._dynamo.graph_break()
    return x * 2


def test_graphs_and_breaks_counts_a_break():
    torch._dynamo.reset()
    assert profiling.graphs_and_breaks(lambda x: x.sin() + 1, torch.ones(3)) == (1, 0)
    assert profiling.graphs_and_breaks(_broken, torch.ones(3)) == (2, 1)


def test_break_reasons_names_an_explicit_break_and_none_without_one():
    torch._dynamo.reset()
    assert profiling.break_reasons(lambda x: x.sin(), torch.ones(3)) == []
    whole = profiling.break_reasons(_broken, torch.ones(3), lines=2, width=10_000)
    assert len(whole) == 1 and len(whole[0].splitlines()) <= 2
    reasons = profiling.break_reasons(_broken, torch.ones(3), lines=2, width=30)
    assert len(reasons) == 1
    # wrapped, not cut: every word of the first two lines is still there
    assert reasons[0].split() == whole[0].split()
    assert len(reasons[0].splitlines()) > len(whole[0].splitlines())


def test_make_forward_runs_the_model_without_a_graph_for_autograd():
    model = torch.nn.Linear(3, 2)
    p_query, p_ref = torch.ones(4, 3), torch.ones(5, 3)
    out = timing.make_forward(lambda q, r: model(q) + r.sum(), p_query, p_ref)()
    assert not out.requires_grad
    assert torch.equal(out, (model(p_query) + 5 * 3).detach())


def test_fake_tensors_run_an_operator_without_data():
    with notebook.fake_tensors():
        x = torch.empty(4, 3)
        y = torch.mm(x, x.T)
    assert y.shape == (4, 4)
    assert type(y).__name__ == "FakeTensor"


@pytest.mark.parametrize(
    "b_runs, overlap",
    [((3.0, 4.0), False), ((0.1, 0.5), False), ((1.5, 9.0), True), ((2.0, 2.0), True)],
)
def test_compare_gives_the_ratio_of_medians_and_whether_the_ranges_overlap(
    b_runs, overlap
):
    rows = [{"variant": "a", "forward_ms": f, "train_ms": 2 * f} for f in (1.0, 2.0)]
    rows += [{"variant": "b", "forward_ms": f, "train_ms": 2 * f} for f in b_runs]
    df = timing.timings_frame(rows)
    out = timing.compare(df, {"a against b": ("a", "b")}, "forward")
    row = out.loc["a against b"]
    assert row["ranges overlap"] is overlap
    assert row["a / b"] == pytest.approx(1.5 / (sum(b_runs) / 2))
    assert row["a range"] == "1.000–2.000"
    train = timing.compare(df, {"x": ("a", "b")}, "train").loc["x"]
    assert train["a ms"] == pytest.approx(3.0)  # the training column, not forward's


def test_compare_names_what_it_cannot_compare():
    df = timing.timings_frame([{"variant": "a", "forward_ms": 1.0, "train_ms": 1.0}])
    with pytest.raises(KeyError, match="'b'"):
        timing.compare(df, {"x": ("a", "b")})
    with pytest.raises(ValueError, match="metric"):
        timing.compare(df, {"x": ("a", "a")}, "backward")
