"""The scaling command's tables (chapter 13): medians and ranges over launches,
speedups, weak-scaling pairs, where several ranks start to pay, traffic per step."""

import json
import math

import pytest

from extkernels.distributed import report
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
    with pytest.raises(ValueError, match="paths: expected files from one machine"):
        merge([str(paths[0]), str(other)])
