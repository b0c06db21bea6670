"""House rules of the repository: lint, canonical notebooks, small committed files."""

import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))
MAX_FILE_BYTES = 2 * 2**20  # every device run carries the whole tree: keep it small


def _tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / f for f in out.stdout.split()]


@pytest.mark.slow
def test_ruff_lint_and_format_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    for args in (["check", "src", "tests", "book"], ["format", "--check", "src", "tests"]):
        result = subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, f"ruff {' '.join(args)}:\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_valid_and_canonical(path):
    text = path.read_text()
    nb = nbformat.reads(text, as_version=4)
    nbformat.validate(nb)
    assert nbformat.writes(nb) + "\n" == text or nbformat.writes(nb) == text, (
        f"{path.name} is not in canonical nbformat: load and save it with nbformat.write"
    )
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", (
        f"{path.name}: kernel must be python3"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executed_in_order(path):
    nb = nbformat.read(path, as_version=4)
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    assert None not in counts, f"{path.name}: some code cells were never executed"
    assert counts == sorted(counts), f"{path.name}: cells were executed out of order"


def test_committed_files_are_small():
    big = [
        (f.relative_to(ROOT), f.stat().st_size)
        for f in _tracked_files()
        if f.exists() and f.stat().st_size > MAX_FILE_BYTES
    ]
    assert not big, f"files over {MAX_FILE_BYTES // 2**20} MiB: {big}"
