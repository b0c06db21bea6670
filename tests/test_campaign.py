"""The campaign command's scheduler: lanes, phases as barriers, jobs that need every
GPU, resuming, failures and timeouts (fake jobs that record where and when they ran),
and its plan and data files."""

import json
import sys
import time
from pathlib import Path

import pytest

from extkernels import campaign, datafiles, provenance
from extkernels.campaign import Job

RECORD = (
    "import json, os, sys, time; t0 = time.time(); time.sleep(float(sys.argv[2])); "
    "json.dump({'lane': os.environ['CUDA_VISIBLE_DEVICES'], 'start': t0, "
    "'end': time.time(), 'nvls': os.environ['NCCL_NVLS_ENABLE']}, "
    "open(sys.argv[1], 'w'))"
)


def job(tmp_path: Path, name: str, phase: int = 0, gpus: int = 1, sleep=0.3) -> Job:
    argv = [sys.executable, "-c", RECORD, str(tmp_path / f"{name}.json"), str(sleep)]
    return Job(name, argv, phase, gpus)


def ran(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_jobs_share_the_lanes_and_a_phase_waits_for_the_one_before(tmp_path):
    jobs = [job(tmp_path, f"a{i}") for i in range(4)] + [job(tmp_path, "b", 1)]
    status = campaign.run_jobs(jobs, ["0", "1"], tmp_path / "out", poll=0.05)
    assert all(s["state"] == "ok" for s in status.values())
    a = [ran(tmp_path, f"a{i}") for i in range(4)]
    assert {r["lane"] for r in a} == {"0", "1"}
    for lane in ("0", "1"):  # one job at a time on a lane
        spans = sorted((r["start"], r["end"]) for r in a if r["lane"] == lane)
        assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:], strict=False))
    assert ran(tmp_path, "b")["start"] >= max(r["end"] for r in a)
    assert {r["nvls"] for r in a} == {"0"}  # NVLink multicast off in every job


def test_a_job_on_every_lane_runs_alone(tmp_path):
    jobs = [job(tmp_path, "one"), job(tmp_path, "all", gpus=-1), job(tmp_path, "two")]
    campaign.run_jobs(jobs, ["0", "1", "2"], tmp_path / "out", poll=0.05)
    alone = ran(tmp_path, "all")
    assert alone["lane"] == "0,1,2"
    for other in ("one", "two"):
        r = ran(tmp_path, other)
        assert r["end"] <= alone["start"] or r["start"] >= alone["end"]


def test_a_resumed_campaign_runs_only_what_did_not_end_well(tmp_path):
    out = tmp_path / "out"
    fails = Job("fails", [sys.executable, "-c", "raise SystemExit('no GPU here')"], 0)
    first = campaign.run_jobs([job(tmp_path, "good"), fails], [""], out, poll=0.05)
    assert first["fails"]["state"] == "failed" and first["fails"]["rc"] == 1
    assert "no GPU here" in (out / "logs" / "fails.log").read_text()
    (tmp_path / "good.json").unlink()
    fixed = Job("fails", [sys.executable, "-c", "pass"], 0)
    again = campaign.run_jobs([job(tmp_path, "good"), fixed], [""], out, poll=0.05)
    assert not (tmp_path / "good.json").exists()  # not run again
    assert again["fails"]["state"] == "ok"


def test_a_job_past_its_time_is_stopped_and_said_so(tmp_path):
    slow = job(tmp_path, "slow", sleep=30)
    t0 = time.time()
    status = campaign.run_jobs([slow], [""], tmp_path / "out", timeout=0.5, poll=0.05)
    assert status["slow"]["state"] == "timeout"
    assert time.time() - t0 < 10


def test_no_job_starts_after_the_time_given_and_the_rest_resume(tmp_path):
    out = tmp_path / "out"
    jobs = [job(tmp_path, f"a{i}", sleep=0.4) for i in range(3)]
    status = campaign.run_jobs(jobs, [""], out, poll=0.05, start_within=0.2)
    assert list(status) == ["a0"] and status["a0"]["state"] == "ok"  # not cut off
    assert not (tmp_path / "a1.json").exists()
    again = campaign.run_jobs(jobs, [""], out, poll=0.05)
    assert set(again) == {"a0", "a1", "a2"}
    assert ran(tmp_path, "a1")["start"] >= ran(tmp_path, "a0")["end"]


def test_the_data_files_are_written_before_the_next_phase(tmp_path):
    seen = []
    jobs = [job(tmp_path, "measure"), job(tmp_path, "chapter", 3)]

    def between(phase):
        seen.append((phase, (tmp_path / "measure.json").exists()))
        assert not (tmp_path / "chapter.json").exists()

    campaign.run_jobs(jobs, ["0"], tmp_path / "out", poll=0.05, between=between)
    assert seen == [(0, False), (3, True)]


def test_a_gpu_named_twice_is_two_lanes_on_it(tmp_path):
    jobs = [job(tmp_path, f"a{i}", sleep=0.5) for i in range(4)]
    status = campaign.run_jobs(jobs, ["0", "0"], tmp_path / "out", poll=0.05)
    assert {tuple(s["lanes"]) for s in status.values()} == {("0",)}
    a = sorted((ran(tmp_path, f"a{i}") for i in range(4)), key=lambda r: r["start"])
    assert {r["lane"] for r in a} == {"0"}
    assert a[1]["start"] < a[0]["end"]  # two at once
    assert a[2]["start"] >= min(a[0]["end"], a[1]["end"])  # never three
    everywhere = job(tmp_path, "all", gpus=-1)
    campaign.run_jobs([everywhere], ["0", "0"], tmp_path / "out2", poll=0.05)
    assert ran(tmp_path, "all")["lane"] == "0"  # each GPU named once


def test_lanes_get_their_own_host_cores(tmp_path):
    cores = [campaign._cores(["0", "1"], [i]) for i in (0, 1)]
    assert not set(cores[0]) & set(cores[1])
    assert sorted(campaign._cores(["0", "1"], [0, 1])) == sorted(cores[0] + cores[1])
    # two lanes on one GPU get their own cores too
    assert campaign._cores(["0", "0"], [0]) == cores[0]


def test_the_plan_times_each_variant_once_and_executes_every_page():
    jobs = campaign.plan(repeats=3)
    names = [j.name for j in jobs]
    assert len(names) == len(set(names))
    from extkernels import variants as V

    here = {v.name for v in V.VARIANTS if v.available()}
    assert {n.removeprefix("bench:") for n in names if n.startswith("bench:")} == here
    pages = {p.stem for p in Path("book").glob("*.ipynb")}
    for kind in ("chapter", "nbval"):
        assert {
            n.removeprefix(f"{kind}:") for n in names if n.startswith(kind)
        } == pages
    phases = [j.phase for j in jobs]
    assert phases == sorted(phases)
    kinds = [
        n.split(":")[0] for n in names if not n.startswith(("chapter", "dist", "nbval"))
    ]
    assert kinds == sorted(kinds, key=["geometry", "tests", "bench", "batched"].index)
    # the GPU tests are one job, its workers handed one test at a time (xdist)
    [tests] = [j for j in jobs if j.name.startswith("tests:")]
    assert tests.argv[1:5] == ["-m", "pytest", "-m", "gpu"]
    assert "tests" in tests.argv and tests.argv[-4:] == ["-n", "4", "--dist", "load"]
    [six] = [j for j in campaign.plan(test_workers=6) if j.name.startswith("tests:")]
    assert six.argv[-4:-2] == ["-n", "6"]
    from extkernels.experiments import batched

    assert {n for n in names if n.startswith("batched:")} == {
        f"batched:{case}" for case in batched.CASES
    }
    assert [j.name for j in jobs if j.gpus == -1] == [
        "distributed:knn",
        "distributed:radius",
        "chapter:13_distributed",
        "nbval:13_distributed",
    ]
    last = max(j.phase for j in jobs if j.name.startswith("chapter:"))
    assert all(j.phase > last for j in jobs if j.name.startswith("nbval:"))
    bench = next(j for j in jobs if j.name == "bench:knn/torch")
    assert bench.argv[bench.argv.index("--repeats") + 1] == "3"


def test_each_geometry_job_times_the_sizes_its_pages_read():
    from extkernels import clouds
    from extkernels.experiments import geometry

    jobs = {j.name: j.argv for j in campaign.plan(repeats=3)}
    for m in [*geometry.METHODS, *geometry.LIBRARIES, *geometry.RADIUS]:
        argv = jobs[f"geometry:{m}"]
        sizes = {int(n) for n in argv[argv.index("--sizes") + 1].split(",")}
        # chapter 14 and the guide read the radius methods at the radius projector's
        # cloud size, the searches at 10^4 to 10^6 points
        want = {clouds.RADIUS_N} if m in geometry.RADIUS else {10**4, 10**5, 10**6}
        assert sizes == want, m


def test_each_file_gets_its_variants_and_the_ones_shown_beside_them(tmp_path):
    from extkernels import variants as V

    parts = tmp_path / "parts" / "bench"
    parts.mkdir(parents=True)
    names = ["knn/torch", "knn/fused+graphs", "knn/fused+graphs@panda", "knn/cpp+aoti"]
    for i, name in enumerate(names):
        _write_part(parts, name, "NVIDIA H200", forward_ms=1.0 + i, day=i + 1)
    data = tmp_path / "data"
    data.mkdir()
    missing = datafiles.write_files(tmp_path, data)
    held = {
        f.name: sorted({r["variant"] for r in json.loads(f.read_text())["runs"]})
        for f in data.glob("*.json")
    }
    assert held["benchmark-h200.json"] == ["knn/fused+graphs", "knn/torch"]
    assert held["benchmark-clouds-h200.json"] == [
        "knn/fused+graphs",
        "knn/fused+graphs@panda",
    ]
    assert held["benchmark-shipping-h200.json"] == ["knn/cpp+aoti", "knn/fused+graphs"]
    available = {v.name for v in V.VARIANTS if v.available()}
    assert set(missing) == available - set(names)


@pytest.mark.parametrize("name", ["knn/torch", "knn/fused+graphs@panda"])
def test_a_variant_belongs_to_the_file_of_its_chapter(name):
    from extkernels import variants as V

    expected = "benchmark-clouds-h200.json" if "@" in name else "benchmark-h200.json"
    kind = datafiles.kind_of(V.get(name))
    assert provenance.data_file(kind) == expected
    other = provenance.data_file(kind, "NVIDIA H100 80GB HBM3")
    assert other == expected.replace("h200", "h100-80gb-hbm3")


def _write_part(parts, name, gpu, forward_ms=1.0, day=1):
    """A benchmark job's part: one run of ``name`` on ``gpu``."""
    run = {"variant": name, "workload": "knn", "forward_ms": forward_ms}
    run |= {"train_ms": 2.0, "peak_mb": 1.0, "hardware": gpu, "first_call_s": 1.0}
    meta = {"hardware": gpu, "date": f"2026-01-0{day}", "versions": {}}
    data = {"meta": meta, "rows": [], "runs": [run]}
    (parts / f"{datafiles.part_slug(name)}.json").write_text(json.dumps(data))


def test_files_are_named_by_the_gpu_their_runs_came_from(tmp_path):
    parts = tmp_path / "parts" / "bench"
    parts.mkdir(parents=True)
    _write_part(parts, "knn/torch", "NVIDIA B200")
    data = tmp_path / "data"
    data.mkdir()
    datafiles.write_files(tmp_path, data)
    assert [f.name for f in data.glob("*.json")] == ["benchmark-b200.json"]


def test_the_batched_cases_make_one_file(tmp_path):
    parts = tmp_path / "parts" / "batched"
    parts.mkdir(parents=True)
    meta = {"hardware": "NVIDIA B200", "date": "today", "repeats": 2, "versions": {}}
    for case in ("batch", "radius"):
        runs = [{"case": case, "method": "m", "ms": 1.0 + r, "run": r} for r in (0, 1)]
        (parts / f"{case}.json").write_text(json.dumps({"meta": meta, "runs": runs}))
    data = tmp_path / "data"
    data.mkdir()
    datafiles.write_files(tmp_path, data)
    written = json.loads((data / "batched-b200.json").read_text())
    assert written["meta"] == meta
    assert sorted({r["case"] for r in written["runs"]}) == ["batch", "radius"]
    assert len(written["runs"]) == 4


def test_runs_from_two_gpus_make_no_file(tmp_path):
    parts = tmp_path / "parts" / "bench"
    parts.mkdir(parents=True)
    _write_part(parts, "knn/torch", "NVIDIA B200")
    _write_part(parts, "knn/fused+graphs", "NVIDIA H200")
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(ValueError, match="one GPU.*B200.*H200"):
        datafiles.write_files(tmp_path, data)
    assert not list(data.glob("*.json"))


def test_a_campaign_first_times_its_machine_variant_on_the_gpu_it_runs_on():
    jobs = campaign.plan(repeats=3, machine="f3b9c79f")
    first = jobs[0]
    assert first.name == "machines:f3b9c79f"
    assert first.produces == "parts/machines/f3b9c79f.json"
    argv = first.argv
    assert argv[argv.index("--variants") + 1] == campaign.MACHINE_VARIANT
    assert argv[argv.index("--json") + 1] == first.produces
    assert argv[argv.index("--repeats") + 1] == "3"
    assert [j.name for j in jobs[1:]] == [j.name for j in campaign.plan(repeats=3)]
    assert not [j for j in campaign.plan() if j.name.startswith("machines:")]


def test_a_gpu_is_named_by_its_uuids_first_digits(monkeypatch):
    uuids = ["GPU-f3b9c79f-42e6-3d92", "GPU-90ad5c10-f626-fe0d"]
    monkeypatch.setattr(provenance, "_per_gpu", lambda field: uuids)
    assert provenance.gpu_uuid("1") == "90ad5c10"
    assert provenance.gpu_uuid("2") is None
    assert provenance.gpu_uuid("") is None  # no GPU: no machine job


def _write_machine(parts, gpu, forward_ms, variant="knn/fused"):
    """A machine job's part: two runs of ``variant`` on the GPU with UUID ``gpu``."""
    runs = [
        {"variant": variant, "workload": "knn", "forward_ms": forward_ms + d}
        | {"train_ms": 2.0, "peak_mb": 1.0, "hardware": "NVIDIA B200"}
        for d in (0.0, 0.5)
    ]
    meta = {"hardware": "NVIDIA B200", "date": "2026-01-01T10:00"}
    meta["versions"] = {"GPU UUID": f"{gpu}-0000", "host CPU": "X (8 cores)"}
    (parts / f"{gpu}.json").write_text(json.dumps({"meta": meta, "runs": runs}))


def test_the_machine_runs_make_one_row_per_gpu(tmp_path):
    parts = tmp_path / "parts" / "machines"
    parts.mkdir(parents=True)
    _write_machine(parts, "aaaaaaaa", 1.0)
    _write_machine(parts, "bbbbbbbb", 3.0)
    data = tmp_path / "data"
    data.mkdir()
    datafiles.write_files(tmp_path, data)
    from extkernels import results

    meta, t = results.load(data / "machines-b200.json")
    assert list(t.index) == ["aaaaaaaa", "bbbbbbbb"]
    assert list(t["forward_min"]) == [1.0, 3.0]
    assert list(t["forward_max"]) == [1.5, 3.5]
    assert set(t["timed"]) == {"knn/fused"}
    assert meta["versions"]["GPU UUID"] == "aaaaaaaa-0000; bbbbbbbb-0000"


def test_the_results_page_shows_each_gpus_runs_without_the_cold_first_call(tmp_path):
    parts = tmp_path / "parts" / "machines"
    parts.mkdir(parents=True)
    _write_machine(parts, "aaaaaaaa", 1.0)
    _write_machine(parts, "bbbbbbbb", 3.0)
    datafiles.write_files(tmp_path, tmp_path)
    from extkernels import results

    _, t = results.load(tmp_path / "machines-b200.json")
    shown = results.machines_table(t)
    assert list(shown.columns) == ["date", "forward ms", "training ms"]
    assert shown.index.name == "GPU (knn/fused)"
    assert shown.at["bbbbbbbb", "forward ms"] == "3.250 (3.000–3.500)"
    assert shown.at["aaaaaaaa", "date"] == "2026-01-01"


def test_machine_runs_of_two_variants_or_twice_one_gpu_make_no_file(tmp_path):
    parts = tmp_path / "parts" / "machines"
    parts.mkdir(parents=True)
    _write_machine(parts, "aaaaaaaa", 1.0)
    _write_machine(parts, "bbbbbbbb", 1.0, variant="knn/cpp")
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(ValueError, match="one variant.*knn/cpp.*knn/fused"):
        datafiles.write_files(tmp_path, data)
    _write_machine(parts, "bbbbbbbb", 1.0)
    (parts / "cccccccc.json").write_text((parts / "aaaaaaaa.json").read_text())
    with pytest.raises(ValueError, match="one file per GPU"):
        datafiles.write_files(tmp_path, data)
    assert not list(data.glob("machines-*.json"))


def test_the_longest_page_starts_first_and_the_others_keep_their_order():
    pages = [j.name for j in campaign.plan() if j.phase == 3]
    assert pages[0] == "chapter:15_shipping"
    assert pages[1:] == sorted(pages[1:], key=lambda n: (n == "chapter:results", n))


def test_only_takes_prefixes_and_whole_names():
    jobs = [
        Job(n, ["true"], 0)
        for n in (
            "bench:radius/warp",
            "bench:radius/warp+1thread",
            "bench:radius/warp+compile+1thread",
            "chapter:01_a",
            "chapter:10_b",
            "nbval:01_a",
        )
    ]
    picked = campaign.select(jobs, "bench:radius/warp$,chapter:0")
    assert [j.name for j in picked] == ["bench:radius/warp", "chapter:01_a"]
    assert len(campaign.select(jobs, "bench:radius/warp")) == 3
    assert campaign.select(jobs, "nbval:01_a$,chapter:") == jobs[3:]


def test_the_books_campaign_keeps_a_part_for_each_measurement_that_ended_well():
    """``campaign/`` (the book's campaign, resumed across sessions) holds only jobs that
    ended well, a part for each of them that writes one, and no part without its job;
    the parts' run cards all name the same host (the campaign spans sessions, each on
    the machine lent then); each benchmark part is the H200 runs of one variant, five
    fresh processes."""
    from extkernels import variants

    root = Path(__file__).resolve().parents[1] / "campaign"
    if not (root / "status.json").exists():
        pytest.skip("no campaign in progress")
    status = json.loads((root / "status.json").read_text())
    assert {s["state"] for s in status.values()} <= {"ok"}
    measuring = ("bench", "geometry", "distributed", "batched", "machines")
    parts = {
        f"{p.parent.name}:{p.stem.replace('__', '/')}": p
        for p in (root / "parts").rglob("*.json")
    }
    assert set(parts) == {n for n in status if n.split(":")[0] in measuring}
    cards = [json.loads(p.read_text()).get("meta", {}) for p in parts.values()]
    hosts = {c["versions"]["host CPU"] for c in cards if "versions" in c}
    assert len(hosts) <= 1, f"the campaign's parts come from several hosts: {hosts}"
    names = {v.name for v in variants.VARIANTS}
    for name, path in parts.items():
        if not name.startswith(("bench:", "machines:")):
            continue
        data = json.loads(path.read_text())
        assert data["meta"]["hardware"] == "NVIDIA H200", name
        kind, detail = name.split(":", 1)
        if kind == "machines":  # the machine variant, on the GPU the job is named by
            assert data["meta"]["versions"]["GPU UUID"].startswith(detail), name
            detail = campaign.MACHINE_VARIANT
        assert {r["variant"] for r in data["runs"]} == {detail} <= names
        assert len(data["runs"]) == data["meta"]["repeats"] == 5, name
