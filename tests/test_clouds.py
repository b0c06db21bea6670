"""The clouds of chapter 14 (:mod:`extkernels.clouds`) and the geometry command's tables
(:mod:`extkernels.experiments.geometry`): shapes, seeds, the meshes' scaling, sampling
by area, and the summaries the chapter reads."""

import json

import numpy as np
import pandas as pd
import pytest
import torch

import extkernels
from extkernels import clouds, results
from extkernels.experiments import geometry


@pytest.mark.parametrize("name", list(clouds.GEOMETRIES))
def test_every_cloud_has_its_size_and_is_the_same_for_a_seed(name):
    w = clouds.workload(name, 500, side=5, seed=3)
    again = clouds.workload(name, 500, side=5, seed=3)
    other = clouds.workload(name, 500, side=5, seed=4)
    assert w.p_ref.shape == (500, 3) and w.p_ref.dtype == torch.float32
    assert w.p_query.shape == (125, 3) and w.p_query.is_contiguous()
    assert torch.equal(w.p_ref, again.p_ref) and torch.equal(w.p_query, again.p_query)
    assert not torch.equal(w.p_ref, other.p_ref)
    assert torch.isfinite(w.p_ref).all() and torch.isfinite(w.p_query).all()


def test_queries_from_the_cloud_are_its_own_points_in_random_order():
    w = clouds.workload("shuffled", 2000, side=6)
    rows = (w.p_query[:, None] == w.p_ref[None]).all(-1).float().argmax(1)
    assert torch.equal(w.p_ref[rows], w.p_query)
    assert not torch.equal(rows, rows.sort().values), "queries in the cloud's order"


def test_the_outlier_is_ten_thousand_units_out_and_the_slab_is_flat():
    assert clouds.workload("outlier", 1000).p_ref[:, 0].max() == 1e4
    extent = clouds.workload("slab", 5000).p_ref.amax(0)
    assert 99 < extent[0] <= 100 and 0.99 < extent[1] <= 1 and extent[2] <= 0.01


@pytest.mark.parametrize("name", list(clouds.MESHES))
def test_meshes_are_read_and_scaled_into_the_unit_box(name):
    tri = clouds.mesh_triangles(name)
    assert tri.ndim == 3 and tri.shape[1:] == (3, 3) and len(tri) > 1000
    corners = tri.reshape(-1, 3)
    half = (corners.max(0) - corners.min(0)) / 2
    assert np.isclose(half.max(), 1.0)
    assert np.allclose((corners.max(0) + corners.min(0)) / 2, 0.0, atol=1e-9)
    w = clouds.workload(name, 3000)
    assert w.p_ref.abs().max() <= 1.0 + 1e-6
    assert w.p_query.abs().max() == pytest.approx(1.1)  # the volume around the part


def test_surface_samples_follow_the_triangles_areas():
    # two triangles in the plane z = 0, the second with three times the area
    tri = np.array(
        [[[0, 0, 0], [1, 0, 0], [0, 1, 0]], [[2, 0, 0], [5, 0, 0], [2, 1, 0]]], float
    )
    p = clouds.sample_surface(tri, 40_000, torch.Generator().manual_seed(0))
    assert p.shape == (40_000, 3) and torch.all(p[:, 2] == 0)
    in_second = (p[:, 0] >= 2).float().mean().item()
    assert in_second == pytest.approx(0.75, abs=0.01)
    first = p[p[:, 0] < 2]
    assert torch.all(first[:, 0] + first[:, 1] <= 1 + 1e-6), "a point off its triangle"


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="^name: expected one of"):
        clouds.workload("torus", 10)
    with pytest.raises(ValueError, match="^n: expected at least one"):
        clouds.workload("normal", 0)
    with pytest.raises(ValueError, match="^name: expected one of"):
        clouds.mesh_triangles("teapot")


def _runs():
    rows = []
    for run, scale in enumerate([1.0, 1.2, 0.9]):
        for name in clouds.GEOMETRIES:
            for n in (100_000, 1_000_000):
                slow = 6.0 if name == "shell" else 1.0
                rows.append(
                    {
                        "geometry": name,
                        "n": n,
                        "method": "fused",
                        "run": run,
                        "ms": 0.1 * slow * scale * n / 1e5,
                    }
                )
                rows.append(
                    {
                        "geometry": name,
                        "n": n,
                        "method": "cuml",
                        "run": run,
                        "ms": 20.0 * scale,
                    }
                )
    return rows


def test_the_table_gives_each_methods_median_and_spread_over_runs():
    t = geometry.table(_runs())
    row = t.loc[("normal", 100_000, "fused")]
    assert row["ms"] == pytest.approx(0.1) and row["runs"] == 3
    assert row["min"] == pytest.approx(0.09) and row["max"] == pytest.approx(0.12)
    wide = geometry.at_size(t, 1_000_000, ["fused", "cuml", "absent"])
    assert list(wide.columns) == ["fused", "cuml"]
    assert list(wide.index) == list(clouds.GEOMETRIES)


def test_tree_times_are_the_medians_and_the_rivals_ratio():
    times = results.tree_times(geometry.table(_runs()))
    assert times.loc["normal", "ms at 10⁶"] == pytest.approx(1.0)
    assert times.loc["normal", "x cuml at 10⁶"] == pytest.approx(20.0)
    assert list(times.columns) == ["ms at 10⁵", "ms at 10⁶", "x cuml at 10⁶"]


def test_the_timed_calls_skip_the_value_checks_after_a_checked_first_call(
    monkeypatch,
):
    from extkernels.ops.checks import value_checks_on

    seen = []
    monkeypatch.setattr(
        geometry,
        "searcher",
        lambda method, w, k: lambda: seen.append(value_checks_on()),
    )
    rows = geometry.time_method("fused", ["normal"], [200], side=3)
    assert seen[0] is True, "the first call runs every check"
    timed = seen[-3 * rows[0]["iters"] :]
    assert timed and not any(timed), "the timed blocks ran with the value checks on"
    assert value_checks_on(), "the switch is left as it was"


def test_a_method_timed_or_checked_again_replaces_only_its_own_rows(tmp_path):
    path = str(tmp_path / "geometry.json")

    def meta(date, host):
        return {"hardware": "GPU", "date": date, "versions": {"host CPU": host}}

    old = [{"method": "fused", "ms": 1.0}, {"method": "cuml", "ms": 20.0}]
    geometry.merge_into(path, {"meta": meta("day 1", "A"), "runs": old, "checks": old})
    new = [{"method": "fused", "ms": 0.5}]
    geometry.merge_into(path, {"meta": meta("day 2", "B"), "runs": new, "checks": new})
    data = json.loads((tmp_path / "geometry.json").read_text())
    assert data["meta"]["date"] == "day 1, day 2"  # cuml's rows are day 1's
    assert data["meta"]["versions"]["host CPU"] == "A; B"  # and host A's
    geometry.merge_into(path, {"meta": meta("day 3", "B"), "runs": new})
    data = json.loads((tmp_path / "geometry.json").read_text())
    assert data["meta"]["versions"]["host CPU"] == "A; B"  # each host once
    for key in ("runs", "checks"):
        assert sorted((r["method"], r["ms"]) for r in data[key]) == [
            ("cuml", 20.0),
            ("fused", 0.5),
        ]


def test_a_library_that_does_not_load_is_listed_as_skipped_not_a_failure(tmp_path):
    path = str(tmp_path / "geometry.json")
    argv = ["bench", "--methods", "cupy-knn", "--geometries", "normal"]
    rc = geometry.main([*argv, "--sizes", "200", "--repeats", "1", "--out", path])
    data = json.loads((tmp_path / "geometry.json").read_text())
    assert rc == 0 and data == {"skipped": ["cupy-knn"]}
    geometry.merge_into(path, {"runs": [{"method": "cupy-knn", "ms": 1.0}]})
    data = json.loads((tmp_path / "geometry.json").read_text())
    assert "skipped" not in data, "a method timed later is no longer skipped"


def test_radius_times_compare_each_cloud_with_the_books():
    rows = [
        {
            "geometry": g,
            "n": 25_000,
            "method": m,
            "run": 0,
            "ms": (3.0 if g == "clusters" else 1.0) * (2 if m == "warp-radius" else 1),
        }
        for g in clouds.GEOMETRIES
        for m in geometry.RADIUS
    ]
    times = results.radius_times(geometry.table(rows))
    assert times.loc["clusters", "fused-radius / normal"] == pytest.approx(3.0)
    assert times.loc["clusters", "warp-radius"] == pytest.approx(6.0)
    assert times.drop("clusters")["fused-radius / normal"].eq(1.0).all()


def test_the_radius_method_aggregates_like_the_backend():
    w = clouds.workload("outlier", 500, side=4)
    got = geometry.searcher("fused-radius", w, 7)()
    feats = torch.randn(500, 25, generator=torch.Generator().manual_seed(0))
    want = extkernels.radius_aggregate(w.p_query, w.p_ref, feats, 0.1, 0.1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_chapters_quotes_read_the_tables_in_plain_python():
    from extkernels.experiments import geometry_report

    grid_small = [
        {"geometry": g, "n": 100_000, "method": "fused-grid", "run": 0, "ms": 0.05}
        for g in clouds.GEOMETRIES
    ]
    t = geometry.table(_runs() + grid_small)
    q = geometry_report.tree_quotes(t)
    assert q["normal_tree_ms"] == pytest.approx(0.1)
    assert q["normal_grid_ms"] == pytest.approx(0.05)
    assert q["tree_max_large_cloud"] == "shell"
    assert q["tree_max_large"] == pytest.approx(6.0)
    assert q["tree_min_x_cuml"] == pytest.approx(20 / 6, abs=1e-3)
    assert all(type(v) in (float, str) for v in q.values())
    grid = [
        {"geometry": g, "n": 1_000_000, "method": m, "run": 0, "ms": ms}
        for g in clouds.GEOMETRIES
        for m, ms in (("fused-grid", 100.0 if g == "panda" else 0.5), ("cuml", 25.0))
    ]
    cliff = geometry_report.cliff_quotes(geometry.table(grid))
    assert cliff["grid_worst"] == "panda" and cliff["grid_worst_x_normal"] == 200.0
    assert cliff["grid_worst_x_cuml"] == pytest.approx(4.0)


def test_mesh_quotes_take_the_worst_ratio_of_the_tree_on_a_mesh():
    from extkernels.experiments import geometry_report

    rows = [
        ("knn/fused+graphs", "normal", 1.0, 1.0),
        ("knn/fused+graphs", "panda", 1.3, 1.1),
        ("radius/fused+graphs", "normal", 1.0, 1.0),
        ("radius/fused+graphs", "panda", 1.7, 1.2),
    ]
    on_clouds = pd.DataFrame(
        rows, columns=["variant", "cloud", "forward / normal", "train / normal"]
    ).set_index(["variant", "cloud"])
    q = geometry_report.mesh_quotes(on_clouds)
    assert q == {"mesh_worst": 1.3, "radius_mesh_fwd": 1.7}


def test_radius_pairs_count_the_neighbours_of_every_query():
    from extkernels import clouds
    from extkernels.experiments import geometry_report

    pairs = geometry_report.radius_pairs(["normal", "panda"], 2_000, 6, 0.3, chunk=50)
    assert pairs.loc["normal", "pairs / normal"] == 1.0
    w = clouds.workload("panda", 2_000, side=6)
    within = torch.cdist(w.p_query, w.p_ref) <= 0.3
    assert pairs.loc["panda", "neighbours per query"] == pytest.approx(
        within.sum(1).double().mean().item()
    )
    assert pairs.loc["panda", "most in one query"] == within.sum(1).max().item()
    share = 100 * within.any(1).double().mean().item()
    assert pairs.loc["panda", "queries with any (%)"] == pytest.approx(share)
