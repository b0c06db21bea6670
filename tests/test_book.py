"""The website builds strictly from the stored notebooks, with a page for every
chapter."""

import pytest
from conftest import ROOT, toc_files


def test_every_toc_entry_exists():
    for f in toc_files():
        assert any((ROOT / f"{f}{ext}").exists() for ext in (".md", ".ipynb")), (
            f"_toc.yml names {f}, which is missing"
        )


def test_every_chapter_notebook_is_in_the_toc():
    listed = set(toc_files())
    for nb in (ROOT / "book").glob("*.ipynb"):
        assert f"book/{nb.stem}" in listed, f"{nb.name} is not listed in _toc.yml"


@pytest.mark.slow
def test_website_has_a_page_per_chapter(built_site):
    for f in toc_files():
        page = built_site / f"{f}.html"
        assert page.exists(), f"no page for {f} in the built website"
        assert "<h1>" in page.read_text(), f"{page} has no title"


@pytest.mark.slow
def test_website_renders_stored_figures(built_site):
    images = list(built_site.rglob("*.png"))
    assert images, "no figure was rendered: are the notebooks' outputs stored?"
