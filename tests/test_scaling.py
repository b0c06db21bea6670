"""The scaling study's arithmetic (chapter 12): slopes and cross-overs of measured
curves, and a sweep that stops where it must."""

import math

import pandas as pd
import pytest

from extkernels.experiments import scaling


def _curve(backend, xs, power, scale=1.0, spread=0.0):
    return pd.DataFrame(
        {
            "backend": backend,
            "n_ref": xs,
            "ms": [scale * x**power for x in xs],
            "min": [scale * x**power * (1 - spread) for x in xs],
            "max": [scale * x**power * (1 + spread) for x in xs],
            "status": "ok",
        }
    )


def test_slopes_recover_the_power_of_each_curve():
    xs = [1e3, 1e4, 1e5, 1e6]
    df = pd.concat([_curve("linear", xs, 1.0), _curve("flat", xs, 0.0, 5.0)])
    s = scaling.slopes(df, "n_ref")
    assert s["linear"] == pytest.approx(1.0)
    assert s["flat"] == pytest.approx(0.0, abs=1e-9)


def test_slopes_ignore_rows_not_measured():
    xs = [1e3, 1e4, 1e5]
    df = _curve("b", xs, 2.0)
    df.loc[2, ["ms", "status"]] = [1.0, "out of memory"]
    assert scaling.slopes(df, "n_ref")["b"] == pytest.approx(2.0)


def test_crossover_is_where_one_curve_stays_below_the_other():
    xs = [1e3, 1e4, 1e5, 1e6]
    cheap_start = _curve("grid", xs, 0.5, 1.0, spread=0.01)  # sqrt(x)
    brute = _curve("brute", xs, 1.0, 1e-2, spread=0.01)  # x / 100: faster below 1e4
    df = pd.concat([cheap_start, brute])
    assert scaling.crossover(df, "grid", "brute", "n_ref") == 1e5
    assert math.isnan(scaling.crossover(df, "brute", "grid", "n_ref"))


def test_a_sweep_stops_a_curve_over_its_budget():
    df = scaling.sweep(
        "knn_aggregate",
        ["torch"],
        [(300, 4), (600, 4), (1200, 4)],
        repeats=1,
        budget_s=0.0,  # every call is over it: only the first size runs
    )
    assert list(df["status"]) == ["ok"] + ["not run (over 0 s per call)"] * 2
    assert df.loc[0, "n_query"] == 64 and df.loc[0, "ms"] > 0


def test_a_tail_slope_reads_the_largest_sizes_only():
    # a fixed cost of 1 ms dominates the small sizes: the whole curve's slope is
    # flattened by it, the tail's is the work's
    xs = [1e2, 1e3, 1e4, 1e5, 1e6]
    df = _curve("b", xs, 1.0, 1e-3)
    df["ms"] = df["ms"] + 1.0
    whole = scaling.slopes(df, "n_ref")["b"]
    tail = scaling.slopes(df, "n_ref", tail=2)["b"]
    assert whole < 0.8
    assert tail == pytest.approx(1.0, abs=0.01)


def test_the_sweeps_read_by_size_and_say_where_a_backend_pays():
    xs = [1e3, 1e4, 1e5, 1e6]
    grid = _curve("grid", xs, 0.5, 1.0, spread=0.01)
    brute = _curve("torch", xs, 1.0, 1e-2, spread=0.01)
    always = _curve("fused", xs, 0.1, 1e-3, spread=0.01)
    sweeps = {("kNN", "N"): pd.concat([grid, brute, always])}
    ms = scaling.value_at(sweeps, "kNN", "N", 1e6, "grid")
    assert ms == pytest.approx(1e3)
    pay = scaling.pays_from(sweeps)
    assert pay.loc["grid", "kNN vs N"] == "100,000"
    assert pay.loc["fused", "kNN vs N"] == "always"
    assert "torch" not in pay.index


def _sweeps():
    # two sizes per sweep; torch runs out of memory at the larger N of kNN
    def sweep(sizes, x, times):
        rows = []
        for backend, ms in times.items():
            for size, t in zip(sizes, ms, strict=True):
                n_ref, n_query = (size, 27) if x == "n_ref" else (100, size)
                ok = t == t
                rows.append(
                    {
                        "backend": backend,
                        "n_ref": n_ref,
                        "n_query": n_query,
                        "ms": t,
                        "min": 0.9 * t,
                        "max": 1.1 * t,
                        "peak MiB": 10.0 * n_ref / 100 if ok else math.nan,
                        "status": "ok" if ok else "out of memory",
                    }
                )
        return pd.DataFrame(rows)

    nan = math.nan
    return {
        ("kNN", "N"): sweep(
            [100, 1000],
            "n_ref",
            {"torch": [1.0, nan], "fused": [0.1, 0.2], "cuml": [2.0, 4.0]},
        ),
        ("radius", "N"): sweep(
            [100, 1000], "n_ref", {"torch": [1.0, 9.0], "fused": [0.1, 0.3]}
        ),
        ("kNN", "M"): sweep(
            [8, 64],
            "n_query",
            {"torch": [1.0, 5.0], "cpp": [0.5, 1.0], "fused": [0.4, 2.0]},
        ),
        ("radius", "M"): sweep(
            [8, 64], "n_query", {"torch": [1.0, 2.0], "fused": [0.1, 0.2]}
        ),
    }


def _measured(sweeps):
    return pd.concat(sweeps, names=["workload", "against"]).droplevel(-1)


def test_size_quotes_read_the_largest_sizes_and_skip_backends_not_swept():
    q = scaling.size_quotes(_sweeps())
    assert q["n_big"] == "1,000" and q["m_big"] == "64"
    assert q["fused_knn_n_big"] == pytest.approx(0.2)
    assert q["cpp_knn_m_big"] == pytest.approx(1.0)
    assert q["cuml_over_fused_n_big"] == pytest.approx(20.0)
    assert "warp_radius_n_big" not in q  # warp was not swept
    assert all(type(v) in (float, str) for v in q.values())


def test_the_time_table_has_a_row_per_size_a_column_per_backend_and_no_nan():
    t = scaling.time_table(_measured(_sweeps()))
    assert list(t.columns) == ["torch", "fused", "cuml", "cpp"]
    assert t.columns.name == "ms per call"  # the unit, over the backends
    assert t.loc[("kNN", "M", 64), "cpp"] == "1.000"
    assert t.loc[("radius", "N", 1000), "torch"] == "9.000"
    assert t.loc[("kNN", "N", 1000), "torch"] == "out of memory"
    assert t.loc[("radius", "M", 8), "cpp"] == "–"  # cpp runs no radius aggregation
    assert not t.isna().any().any()


def test_stops_name_the_sizes_in_words_and_quote_the_brute_force():
    stopped = scaling.stops(_measured(_sweeps()))
    assert list(stopped.columns) == [
        "workload",
        "against",
        "backend",
        "points N",
        "queries M",
        "status",
    ]
    assert len(stopped) == 1 and stopped.iloc[0]["status"] == "out of memory"
    assert scaling.stop_quotes(stopped) == {"torch_stop_knn_N": "1,000"}


def test_memory_table_is_against_points_in_words():
    table = scaling.memory_table(_measured(_sweeps()))
    assert table.index.names == ["workload", "points N"]
    assert table.columns.name == "peak MiB"
    assert table.loc[("kNN", 1000), "fused"] == "100"
    assert table.loc[("kNN", 1000), "torch"] == "–"  # ran out of memory


def test_readable_rounds_separates_thousands_and_marks_what_is_missing():
    table = pd.DataFrame({"a": [0.4712, math.nan], "b": [41211.4, 2.0]})
    assert scaling.readable(table, 2).values.tolist() == [
        ["0.47", "41,211.40"],
        ["–", "2.00"],
    ]


def test_slope_and_variant_quotes_use_the_names_the_prose_reads():
    slopes = pd.DataFrame({"kNN vs N": {"torch": 0.9, "warp": math.nan}})
    assert scaling.slope_quotes(slopes) == {"slope_knn_vs_N_torch": 0.9}
    part = pd.DataFrame(
        {"train_ms": [0.1, 0.5, 2.0], "forward_ms": [0.05, 0.3, 1.0]},
        index=["knn/floor", "knn/fused", "knn/torch"],
    )
    q = scaling.variant_quotes({"kNN projector": part})
    assert q["knn_best"] == "knn/fused"  # the floor aggregates nothing
    assert q["knn_best_train"] == 0.5 and q["knn_worst_train"] == 2.0
    assert q["knn_best_fwd"] == 0.3 and q["knn_n_variants"] == 3
    assert q["knn_runner_up"] == "knn/torch" and q["knn_runner_up_train"] == 2.0


def test_the_runner_up_is_another_projector_not_the_fastest_with_a_setting_changed():
    part = pd.DataFrame(
        {"train_ms": [0.5, 0.51, 0.6], "forward_ms": [0.2, 0.2, 0.3]},
        index=[
            "knn/fused+compile+graphs",
            "knn/fused+compile+graphs+inductor-defaults",
            "knn/fused+graphs",
        ],
    )
    q = scaling.variant_quotes({"kNN projector": part})
    assert q["knn_runner_up"] == "knn/fused+graphs" and q["knn_runner_up_train"] == 0.6
    assert q["knn_n_variants"] == 3  # still counted and shown


def test_variant_quotes_are_names_and_numbers_with_or_without_the_ranges():
    part = pd.DataFrame(
        {
            "train_ms": [0.2, 0.5, 0.65],
            "train_min": [0.2, 0.48, 0.6],
            "train_max": [0.2, 0.52, 0.7],
            "forward_ms": [0.1, 0.2, 0.3],
        },
        index=["radius/floor", "radius/fused", "radius/warp"],
    )
    q = scaling.variant_quotes({"radius projector": part})
    assert q["radius_best"] == "radius/fused" and q["radius_runner_up"] == "radius/warp"
    assert q["radius_best_train"] == 0.5 and q["radius_runner_up_train"] == 0.65
    assert q == scaling.variant_quotes(
        {"radius projector": part[["train_ms", "forward_ms"]]}
    )
    names = {"radius_best", "radius_runner_up"}
    assert all(type(v) in (float, int) for k, v in q.items() if k not in names)


def test_the_panels_label_their_axes_in_words():
    import matplotlib

    matplotlib.use("Agg")
    sweeps = _sweeps()
    fig = scaling.sweep_panels(sweeps, hardware="CPU")
    labels = [ax.get_xlabel() for ax in fig.axes]
    assert labels == ["points N", "points N", "queries M", "queries M"]
    fig = scaling.memory_panels(_measured(sweeps), hardware="CPU")
    assert [ax.get_xlabel() for ax in fig.axes] == ["points N", "points N"]
    assert scaling.size_column("M") == "n_query"
