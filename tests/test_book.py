"""The website builds strictly from the stored notebooks, with a page for every chapter."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [ch["file"] for ch in part["chapters"]]
    return files


def test_every_toc_entry_exists():
    for f in _toc_files():
        assert any((ROOT / f"{f}{ext}").exists() for ext in (".md", ".ipynb")), (
            f"_toc.yml names {f}, which is missing"
        )


def test_every_chapter_notebook_is_in_the_toc():
    listed = set(_toc_files())
    for nb in (ROOT / "book").glob("*.ipynb"):
        assert f"book/{nb.stem}" in listed, f"{nb.name} is not listed in _toc.yml"


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    jb = shutil.which("jupyter-book") or str(Path(sys.executable).with_name("jupyter-book"))
    result = subprocess.run(
        [jb, "build", str(ROOT), "--path-output", str(out), "-W", "-n", "--keep-going"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, (
        f"website build failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    )
    return out / "_build" / "html"


@pytest.mark.slow
def test_website_has_a_page_per_chapter(built_site):
    for f in _toc_files():
        page = built_site / f"{f}.html"
        assert page.exists(), f"no page for {f} in the built website"
        assert "<h1>" in page.read_text(), f"{page} has no title"


@pytest.mark.slow
def test_website_renders_stored_figures(built_site):
    images = list(built_site.rglob("*.png"))
    assert images, "no figure was rendered: are the notebooks' outputs stored?"
