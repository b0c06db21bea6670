"""extkernels.timing: timing calls and projectors, and tabling and comparing timings."""

import math

import pytest
import torch

import extkernels
from extkernels import timing


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


def test_make_forward_runs_the_model_without_a_graph_for_autograd():
    model = torch.nn.Linear(3, 2)
    p_query, p_ref = torch.ones(4, 3), torch.ones(5, 3)
    out = timing.make_forward(lambda q, r: model(q) + r.sum(), p_query, p_ref)()
    assert not out.requires_grad
    assert torch.equal(out, (model(p_query) + 5 * 3).detach())


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


def test_a_budget_times_checked_once_then_unchecked_blocks():
    from extkernels.ops.checks import value_checks_on

    seen = []
    ms, lo, hi, n_iters = timing.time_within_budget(
        lambda: seen.append(value_checks_on()), budget_ms=1e9, most=4, repeats=3
    )
    assert n_iters == 4  # the budget allows more: the most
    # the first call's checked, then every block's (with the timer's warm-ups) not
    assert seen[0] and seen == sorted(seen, reverse=True)
    assert seen.count(False) >= 3 * 4
    assert lo <= ms <= hi


def test_the_runs_table_keeps_the_order_first_met():
    rows = [
        {"case": c, "method": m, "ms": v}
        for c, m, v in [("b", "x", 3.0), ("a", "y", 1.0), ("b", "x", 1.0)]
    ]
    table = timing.runs_table(rows, ["case", "method"])
    assert list(table.index) == [("b", "x"), ("a", "y")]
    assert table.loc[("b", "x")].tolist() == [2.0, 1.0, 3.0, 2]
