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


def test_the_sweeps_read_by_size_compare_and_say_where_a_backend_pays():
    xs = [1e3, 1e4, 1e5, 1e6]
    grid = _curve("grid", xs, 0.5, 1.0, spread=0.01)
    brute = _curve("torch", xs, 1.0, 1e-2, spread=0.01)
    always = _curve("fused", xs, 0.1, 1e-3, spread=0.01)
    sweeps = {("kNN", "N"): pd.concat([grid, brute, always])}
    ms = scaling.value_at(sweeps, "kNN", "N", 1e6, "grid")
    assert ms == pytest.approx(1e3)
    assert scaling.compare_at(sweeps, "kNN", "N", 1e6, "grid", "torch") == "faster than"
    assert scaling.compare_at(sweeps, "kNN", "N", 1e3, "grid", "torch") == "slower than"
    pay = scaling.pays_from(sweeps)
    assert pay.loc["grid", "kNN vs N"] == "100,000"
    assert pay.loc["fused", "kNN vs N"] == "always"
    assert "torch" not in pay.index
