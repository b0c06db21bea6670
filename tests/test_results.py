"""extkernels.results and extkernels.guide: the tables, the guide and the answer."""

import json
from pathlib import Path

import pandas as pd
import pytest

from extkernels import results


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


def test_the_run_card_counts_the_gpus_behind_a_file():
    meta = {"hardware": "GPU", "date": "2026-01-02T09:03:13+00:00"}
    one = "5e1a09c2-0000-1111-2222-333344445555"
    two = "77b0e3d1-0000-1111-2222-333344445555"
    meta["versions"] = {"GPU UUID": f"not recorded; {one}; {two}"}
    card = results.run_card(meta, pd.DataFrame({"repeats": [5]}))
    assert card.loc["GPU UUID", "benchmark run"] == (
        "2 GPUs: not recorded, 5e1a09c2…, 77b0e3d1…"
    )
    assert results.gpus(one) == "1 GPU: 5e1a09c2…"
