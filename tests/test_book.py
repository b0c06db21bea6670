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


#: Tags under which Jupyter Book leaves a cell's stderr off the page.
STDERR_HIDDEN = {"remove-stderr", "remove-output", "remove-cell"}


def stderr_on_page(path) -> list[int]:
    """The code cells (indices) whose stored stderr the page would show."""
    import nbformat

    shown = []
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type != "code" or STDERR_HIDDEN & set(
            cell.metadata.get("tags", [])
        ):
            continue
        if any(
            o.get("output_type") == "stream" and o.get("name") == "stderr"
            for o in cell.get("outputs", [])
        ):
            shown.append(i)
    return shown


@pytest.mark.parametrize("path", sorted((ROOT / "book").glob("*.ipynb")), ids=str)
def test_no_stderr_reaches_the_page(path):
    # Warnings and logs of the libraries (cudagraph skips, profiler markers, a cuBLAS
    # context notice) are kept in the notebook for nbval but left off the website.
    assert not stderr_on_page(path), (
        f"{path.name}: cells {stderr_on_page(path)} show stderr"
    )


def test_the_stderr_rule_sees_one(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("import warnings; warnings.warn('x')")
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stderr", text="UserWarning: x")
    ]
    hidden = nbformat.v4.new_code_cell("1", metadata={"tags": ["remove-stderr"]})
    hidden.outputs = list(cell.outputs)
    nb.cells = [hidden, cell]
    nbformat.write(nb, tmp_path / "page.ipynb")
    assert stderr_on_page(tmp_path / "page.ipynb") == [1]
