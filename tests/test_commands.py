"""The package's commands, each run in a subprocess as a reader runs it: the benchmark
command and the execution command."""

import json
import os
import subprocess
import sys

import nbformat
import pytest
import torch

from extkernels import execute as execute_command
from extkernels import variants as V

pytestmark = pytest.mark.slow


def _command(*args, cwd, timeout=120, **env):
    full_env = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---------------------------------------------------------------- benchmark command


@pytest.fixture(scope="module")
def benchmark_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "out.json"
    proc = _command(
        "extkernels.benchmark",
        "--variants",
        "knn/torch",
        "--repeats",
        "2",
        "--json",
        str(out),
        cwd=tmp,
        EXTKERNELS_SMALL="1",
    )
    return proc, out


def test_benchmark_command_exits_zero(benchmark_run):
    proc, _ = benchmark_run
    assert proc.returncode == 0, proc.stderr


def test_benchmark_command_writes_the_baseline_with_unit_speedup(benchmark_run):
    _, out = benchmark_run
    data = json.loads(out.read_text())
    rows = {row["variant"]: row for row in data["rows"]}
    assert list(rows) == ["knn/torch"]
    assert rows["knn/torch"]["forward_speedup"] == 1.0
    assert rows["knn/torch"]["train_speedup"] == 1.0
    assert rows["knn/torch"]["forward_ms"] > 0


def test_benchmark_command_records_hardware_and_sizes(benchmark_run):
    _, out = benchmark_run
    meta = json.loads(out.read_text())["meta"]
    assert meta["versions"]["torch"] == torch.__version__
    assert set(meta["sizes"]) == {"n_ref", "n_ref_radius", "n_query"}
    assert json.loads(out.read_text())["rows"][0]["n_ref"] == meta["sizes"]["n_ref"]


def test_benchmark_command_records_every_run_and_the_spread(benchmark_run):
    _, out = benchmark_run
    data = json.loads(out.read_text())
    assert data["meta"]["repeats"] == 2 and data["meta"]["date"]
    runs = [r["forward_ms"] for r in data["runs"]]
    row = data["rows"][0]
    assert len(runs) == 2 and row["repeats"] == 2
    assert (row["forward_min"], row["forward_max"]) == (min(runs), max(runs))
    assert row["forward_min"] <= row["forward_ms"] <= row["forward_max"]


def test_benchmark_first_run_is_cold_and_the_later_ones_warm(benchmark_run):
    _, out = benchmark_run
    cold, warm = json.loads(out.read_text())["runs"]
    assert cold["first_call_s"] > 0 and cold["warm_first_call_s"] is None
    assert warm["first_call_s"] is None and warm["warm_first_call_s"] > 0


def test_a_variants_runs_share_compiler_caches_that_start_empty(monkeypatch):
    from extkernels import benchmark
    from extkernels.problem import problem

    seen = []

    def fake(name, *, cold, caches):
        folders = {os.path.join(caches, sub) for sub in benchmark.CACHES.values()}
        seen.append((name, cold, caches, any(os.path.exists(f) for f in folders)))
        os.makedirs(os.path.join(caches, "triton"), exist_ok=True)  # a run fills it
        return [V.run(V.get(name), problem(), cold=cold)]

    monkeypatch.setattr(benchmark, "_run_isolated", fake)
    monkeypatch.setenv("EXTKERNELS_SMALL", "1")
    benchmark.run_all(["knn/torch", "knn/torch+compile"], repeats=2, verbose=False)
    assert [(n, c, filled) for n, c, _, filled in seen] == [
        ("knn/torch", True, False),
        ("knn/torch", False, True),
        ("knn/torch+compile", True, False),
        ("knn/torch+compile", False, True),
    ]
    assert seen[0][2] == seen[1][2] != seen[2][2]  # one folder per variant
    assert not any(os.path.exists(folder) for *_, folder, _ in seen)


def test_benchmark_list_names_every_variant(tmp_path):
    proc = _command("extkernels.benchmark", "--list", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    listed = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    assert listed == [v.name for v in V.VARIANTS]
    assert not (tmp_path / "benchmark.json").exists()


# ---------------------------------------------------------------- execute command


def _write_notebook(path, *sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in sources]
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("nb_ok")
    path = _write_notebook(
        folder / "ok.ipynb", "1 + 1", "print('hello')", "import os; print(os.getcwd())"
    )
    proc = _command("extkernels.execute", str(path), cwd=tmp_path_factory.getbasetemp())
    return proc, path, folder


def test_execute_exits_zero(executed):
    proc, _, _ = executed
    assert proc.returncode == 0, proc.stderr


def test_execute_stores_execution_counts(executed):
    _, path, _ = executed
    nb = nbformat.read(path, as_version=4)
    assert [cell.execution_count for cell in nb.cells] == [1, 2, 3]


def test_execute_stores_outputs(executed):
    _, path, _ = executed
    cells = nbformat.read(path, as_version=4).cells
    assert cells[0].outputs[0]["data"]["text/plain"] == "2"
    assert cells[1].outputs[0]["text"] == "hello\n"


def test_execute_runs_in_the_notebook_folder(executed):
    _, path, folder = executed
    cells = nbformat.read(path, as_version=4).cells
    assert os.path.samefile(cells[2].outputs[0]["text"].strip(), folder)


def test_execute_stores_figures_when_the_caller_chose_a_script_backend(tmp_path):
    # MPLBACKEND=Agg suits the scripts the GPU machine runs; the notebooks' kernel must
    # still draw inline, or the chapters lose their figures.
    path = _write_notebook(
        tmp_path / "fig.ipynb",
        "import matplotlib.pyplot as plt\nplt.plot([0, 1], [1, 0]);",
    )
    proc = _command("extkernels.execute", str(path), cwd=tmp_path, MPLBACKEND="Agg")
    assert proc.returncode == 0, proc.stderr
    outputs = nbformat.read(path, as_version=4).cells[0].outputs
    assert any("image/png" in o.get("data", {}) for o in outputs), outputs


def _captioned(source):
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["mystnb"] = {"figure": {"caption": "A figure."}}
    return cell


def test_execute_refuses_a_captioned_cell_that_drew_no_figure(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [_captioned("x = 1  # draws nothing")]
    path = tmp_path / "nofig.ipynb"
    nbformat.write(nb, path)
    before = path.read_bytes()
    proc = _command("extkernels.execute", str(path), cwd=tmp_path)
    assert proc.returncode != 0
    assert "drew no figure" in proc.stderr
    assert path.read_bytes() == before


def test_missing_figures_accepts_a_figure_or_a_skip_message():
    nb = nbformat.v4.new_notebook()
    drawn, skipped, empty = (_captioned("") for _ in range(3))
    drawn.outputs = [nbformat.v4.new_output("display_data", {"image/png": "iVBO"})]
    skip = nbformat.v4.new_output("stream", name="stdout", text="skipped: no GPU")
    skipped.outputs = [skip]
    nb.cells = [drawn, skipped, empty, nbformat.v4.new_code_cell("")]
    assert execute_command.missing_figures(nb) == [2]


def test_crowded_figures_finds_a_table_shown_beside_a_captioned_plot():
    nb = nbformat.v4.new_notebook()
    alone, crowded = _captioned(""), _captioned("")
    png = nbformat.v4.new_output("display_data", {"image/png": "iVBO"})
    table = nbformat.v4.new_output("display_data", {"text/html": "<table></table>"})
    alone.outputs = [png, nbformat.v4.new_output("stream", name="stdout", text="ok")]
    crowded.outputs = [table, png]
    nb.cells = [alone, crowded, nbformat.v4.new_code_cell("")]
    assert execute_command.crowded_figures(nb) == [1]


def test_execute_refuses_a_captioned_cell_that_also_shows_a_table(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        _captioned(
            "import matplotlib.pyplot as plt\nfrom IPython.display import display\n"
            "display({'a': 1})\nplt.plot([0, 1], [1, 0]);"
        )
    ]
    path = tmp_path / "crowded.ipynb"
    nbformat.write(nb, path)
    before = path.read_bytes()
    proc = _command("extkernels.execute", str(path), cwd=tmp_path)
    assert proc.returncode != 0
    assert "display more than their figure" in proc.stderr
    assert path.read_bytes() == before


def test_execute_failing_notebook_exits_non_zero_and_leaves_file_unchanged(tmp_path):
    path = _write_notebook(tmp_path / "bad.ipynb", "x = 1", "raise ValueError('boom')")
    before = path.read_bytes()
    proc = _command("extkernels.execute", str(path), cwd=tmp_path)
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr
    assert path.read_bytes() == before


def test_execute_folder_runs_the_rest_after_a_failure_and_skips_underscored(tmp_path):
    bad = _write_notebook(tmp_path / "a_bad.ipynb", "raise ValueError('boom')")
    good = _write_notebook(tmp_path / "b_good.ipynb", "1 + 1")
    hidden = _write_notebook(tmp_path / "_hidden.ipynb", "1 + 1")
    bad_before, hidden_before = bad.read_bytes(), hidden.read_bytes()
    proc = _command("extkernels.execute", str(tmp_path), cwd=tmp_path)
    assert proc.returncode != 0
    assert bad.read_bytes() == bad_before
    assert hidden.read_bytes() == hidden_before
    assert nbformat.read(good, as_version=4).cells[0].execution_count == 1


def test_execute_rejects_a_path_that_is_not_a_notebook(tmp_path):
    other = tmp_path / "notes.txt"
    other.write_text("not a notebook")
    proc = _command("extkernels.execute", str(other), cwd=tmp_path)
    assert proc.returncode != 0
    assert "paths:" in proc.stderr


def test_execute_runs_the_rest_after_a_cell_timeout(tmp_path):
    _write_notebook(tmp_path / "a_slow.ipynb", "import time; time.sleep(30)")
    good = _write_notebook(tmp_path / "b_good.ipynb", "1 + 1")
    proc = _command("extkernels.execute", str(tmp_path), "--timeout", "1", cwd=tmp_path)
    assert proc.returncode != 0
    assert nbformat.read(good, as_version=4).cells[0].execution_count == 1


def test_benchmark_merge_rebuilds_one_table_from_the_files(benchmark_run, tmp_path):
    _, out = benchmark_run
    merged = tmp_path / "merged.json"
    proc = _command(
        "extkernels.benchmark",
        "--merge",
        str(out),
        str(out),
        "--json",
        str(merged),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    data, once = json.loads(merged.read_text()), json.loads(out.read_text())
    # the second file times the same variants again: its runs replace the first's
    assert len(data["runs"]) == len(once["runs"])
    assert data["rows"][0]["repeats"] == once["rows"][0]["repeats"]
    assert data["rows"][0]["forward_ms"] == pytest.approx(once["rows"][0]["forward_ms"])
    assert data["meta"]["date"] == once["meta"]["date"]  # the same date, once
