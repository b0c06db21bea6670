"""The scaling command's tables (chapter 13): medians and ranges over launches,
speedups, weak-scaling pairs, where several ranks start to pay, traffic per step."""

import json
import math

import pandas as pd
import pytest

from extkernels.distributed import report
from extkernels.distributed.bench import part_of
from extkernels.distributed.command import merge


def _run(layout, world, n, train, run, workload="knn"):
    return {
        "workload": workload,
        "layout": layout,
        "world": world,
        "n_ref": n,
        "n_query": 27,
        "forward_ms": train / 2,
        "train_ms": train,
        "peak_mb": 1.0,
        "run": run,
    }


# one device: 1 ms at 10, 4 ms at 100, 16 ms at 1000; two ranks: 3, 3 and 5 ms,
# each over three launches that spread by +-0.5 ms
RUNS = [
    _run(layout, world, n, t + d, run)
    for run, d in enumerate((-0.5, 0.0, 0.5))
    for layout, world, times in (
        ("single", 1, (1, 4, 16)),
        ("reference", 1, (2, 5, 9)),
        ("reference", 2, (3, 3, 5)),
    )
    for n, t in zip((10, 100, 1000), times, strict=True)
] + [_run("reference", 2, 20, 4.5, run) for run in range(3)]


def test_the_table_keeps_median_and_range_of_the_launches():
    tab = report.frame(RUNS)
    row = tab[(tab["config"] == "reference x 2") & (tab["n_ref"] == 100)].iloc[0]
    assert (row["train_ms"], row["train_min"], row["train_max"]) == (3, 2.5, 3.5)
    assert row["runs"] == 3
    assert set(tab["config"]) == {"one device", "reference x 1", "reference x 2"}


def test_speedups_are_ratios_of_medians_over_one_device():
    s = report.speedups(report.frame(RUNS))
    assert s.loc[("knn", 1000), "reference x 2"] == pytest.approx(16 / 5, abs=0.01)
    assert s.loc[("knn", 10), "one device"] == 1.0


def test_the_strong_table_shows_median_and_range():
    cell = report.strong(report.frame(RUNS)).loc[("knn", 100), "reference x 2"]
    assert cell == "3 (2.5–3.5)"


def test_weak_scaling_pairs_n_on_one_rank_with_w_times_n_on_w():
    weak = report.weak(report.frame(RUNS))
    (row,) = weak.to_dict("records")  # only 10 on one rank has 20 on two
    assert (row["points per rank"], row["ranks"]) == (10, 2)
    assert row["efficiency"] == pytest.approx(2 / 4.5, abs=0.01)


def test_scaling_out_pays_from_the_first_size_beyond_the_spread():
    tab = report.frame(RUNS)
    # at 100: 3.5 ms (slowest) against 3.5 ms (fastest): not yet
    assert report.pays_from(tab, "reference x 2") == {"knn": 1000.0}
    assert math.isnan(report.pays_from(tab, "one device")["knn"])  # never beats itself


def test_traffic_counts_what_a_rank_receives():
    t = report.traffic(m=1000, k=7, f=25, world=4, params=100).set_index(
        ["layout", "exchange", "workload"]
    )["KiB"]
    # 3 other ranks send 1000 x 7 candidates of a float32 and an int64 each
    assert t[("reference", "kNN candidates: all-gather", "kNN")] == round(
        3 * 1000 * 7 * 12 / 1024, 1
    )
    # 2 (W - 1) / W of the gradients, 4 bytes each
    assert t[("queries", "DDP: all-reduce of the gradients", "both")] == round(
        1.5 * 400 / 1024, 1
    )


def test_merged_files_keep_every_run_and_profile(tmp_path):
    paths = []
    for i, date in enumerate(("2026-01-01", "2026-01-02")):
        meta = {"hardware": "2 x GPU", "date": date, "command": f"bench {i}"}
        runs = [_run("single", 1, 10, 1.0 + i, 0, workload=("knn", "radius")[i])]
        profiles = [{"workload": ("knn", "radius")[i]}]
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(
            json.dumps({"meta": meta, "runs": runs, "profiles": profiles})
        )
    out = merge([str(p) for p in paths])
    assert [r["workload"] for r in out["runs"]] == ["knn", "radius"]
    assert len(out["profiles"]) == 2
    assert out["meta"]["date"] == "2026-01-01, 2026-01-02"
    other = tmp_path / "other.json"
    other.write_text(
        json.dumps({"meta": dict(meta, hardware="CPU"), "runs": [], "profiles": []})
    )
    with pytest.raises(ValueError, match="paths: expected files from one kind of GPU"):
        merge([str(paths[0]), str(other)])


def _profile(layout, world, mm, ours, rest, workload="radius"):
    parts = {"matrix products": mm, "the book's kernels": ours, "everything else": rest}
    total = mm + ours + rest
    return {
        "workload": workload,
        "layout": layout,
        "world": world,
        "n_ref": 1000,
        "comm_ms": 0.1 * (world > 1),
        "total_ms": total,
        "comm_share": 0.1 * (world > 1) / total,
        "parts": dict(parts, total=total),
    }


def test_parts_set_each_rank_beside_one_device_in_order_of_ranks():
    profiles = pd.DataFrame(
        [
            _profile("reference", 4, 1.5, 0.4, 1.0),
            _profile("single", 1, 6.0, 2.0, 2.0),
            _profile("reference", 2, 3.0, 0.5, 1.0),
            _profile("reference", 1, 6.0, 2.0, 2.5),
            _profile("single", 1, 9.0, 9.0, 9.0, workload="knn"),
        ]
    )
    p = report.parts(profiles, "radius")
    assert list(p.columns[:4]) == [
        f"{c} (ms)"
        for c in ("one device", "reference x 1", "reference x 2", "reference x 4")
    ]
    assert p.loc["the book's kernels", "one device / reference x 2"] == 4.0  # 2 / 0.5
    assert p.loc["the whole step", "one device / reference x 2"] == round(10 / 4.5, 2)
    assert "one device / reference x 1" not in p.columns
    comm = report.communication(profiles)
    assert list(comm["config"][:2]) == ["reference x 4", "one device"]
    assert comm["communication (%)"].iloc[1] == 0


def test_headlines_name_what_the_prose_quotes():
    tab = report.frame(RUNS)
    profiles = pd.DataFrame(
        [
            _profile("single", 1, 6.0, 2.0, 2.0, workload="knn"),
            _profile("reference", 2, 3.0, 0.5, 1.0, workload="knn"),
        ]
    )
    h = report.headlines(tab, profiles)
    assert (h["n_big"], h["n_small"]) == ("1,000", "10")
    assert h["knn_train_big_reference_x2"] == pytest.approx(16 / 5, abs=0.01)
    assert h["knn_train_small_reference_x2"] == pytest.approx(1 / 3, abs=0.01)
    assert not any(k.endswith("_x1") for k in h)  # one rank divides nothing
    assert "knn_train_doubling" not in h  # no run at half the largest cloud
    assert h["knn_ours_x2"] == 4.0 and h["knn_step_x2"] == round(10 / 4.5, 2)
    assert h["knn_comm_pct_x2"] == pytest.approx(100 * 0.1 / 4.5)
    weak = report.weak(tab)
    assert (
        h["knn_weak_10_x2"]
        == weak.loc[weak["points per rank"] == 10, "efficiency"].item()
    )


def test_an_operator_counts_in_its_part_autograd_nodes_of_the_book_included():
    assert part_of("aten::addmm") == "matrix products"
    assert part_of("extkernels_fused::knn") == "the book's kernels"
    # the forward of an operator with a registered autograd runs under its node's name
    node = "GeneratedBackwardFor_extkernels_fused_radius_aggregate_fwd_def"
    assert part_of(node) == "the book's kernels"
    assert part_of("aten::threshold_backward") == "everything else"


def test_the_scaling_figure_has_a_panel_per_workload_and_metric_and_one_legend():
    runs = RUNS + [dict(r, workload="radius") for r in RUNS]
    fig = report.scaling_panels(report.frame(runs), hardware="2 x GPU")
    titles = [ax.get_title().splitlines()[0] for ax in fig.axes]
    assert titles == [
        "kNN: forward pass",
        "kNN: training step",
        "radius: forward pass",
        "radius: training step",
    ]
    assert {ax.get_xlabel() for ax in fig.axes} == {"points in the cloud, N"}
    assert all(ax.get_legend() is None for ax in fig.axes)
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "one device",
        "reference x 1",
        "reference x 2",
    ]
