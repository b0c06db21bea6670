"""The guide's words about each backend agree with what the backend registers: an
autograd formula named only where the operator has one (read from the operator,
``Backend.has_autograd``), and cuML's search named as the algorithm the book's operator
runs (chapter 3), never as a brute force. The guide and its glossary, generated from the
backends' book records, are the tables the results page shows.

The guide is the table the results page opens with and chapter 12 derives
(:func:`extkernels.guide.guide`)."""

import re
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import torch
from conftest import ROOT, toc_files

from extkernels import guide, results
from extkernels.experiments import geometry
from extkernels.ops import cuml, registry

DATA = ROOT / "book" / "data"


@pytest.fixture(scope="module")
def table():
    _, bench = results.load(DATA / "benchmark-h200.json")
    _, clouds = results.load(DATA / "benchmark-clouds-h200.json")
    _, times, _ = geometry.load(DATA / "geometry-h200.json")
    return guide.guide(bench, clouds, times), times


#: Each row of the guide: situation -> (its backend, the operation whose operator it
#: describes, None for plain PyTorch).
ROWS = {row.situation: (backend, row.operation) for backend, row in guide.advice()}


def _stored(cell_source: str) -> str:
    """The HTML the results page stores for its one cell whose source is
    ``cell_source``."""
    nb = nbformat.read(ROOT / "book" / "results.ipynb", as_version=4)
    (cell,) = [c for c in nb.cells if c.source.strip() == cell_source]
    (html,) = [o["data"]["text/html"] for o in cell.outputs if "data" in o]
    return html


def _lines_masked(html: str) -> str:
    """``html`` with the backends' source lines left out: a change of code, not of
    data, changes them."""
    return re.sub(r"[\d,]+ lines;", "N lines;", html)


def test_the_guide_is_the_one_the_results_page_shows():
    """The rows, their order, the columns and every word of the guide the backends'
    records generate are those the results page stores (that cell is not compared under
    nbval: the source lines it counts change with the code)."""
    _, bench = results.load(DATA / "benchmark-h200.json")
    _, clouds = results.load(DATA / "benchmark-clouds-h200.json")
    _, shipping = results.load(DATA / "benchmark-shipping-h200.json")
    _, times, _ = geometry.load(DATA / "geometry-h200.json")
    with pd.option_context("display.max_colwidth", None):
        html = guide.guide(bench, clouds, times, shipping)._repr_html_()
    stored = _stored("guide.guide(table, clouds, times, shipping)")
    assert _lines_masked(html) == _lines_masked(stored)


def test_the_glossary_is_the_one_the_results_page_shows():
    shown = pd.Series(guide.GLOSSARY, name="meaning").rename_axis("part of the name")
    with pd.option_context("display.max_colwidth", None):
        html = shown.to_frame()._repr_html_()
    source = (
        'pd.Series(guide.GLOSSARY, name="meaning").rename_axis("part of the name")'
        ".to_frame()"
    )
    assert html == _stored(source)


def test_has_autograd_asks_the_definition_not_the_autograd_key():
    """A custom_op always has an Autograd kernel (one that raises without a formula):
    the dispatcher's key alone would say every custom operator has a backward."""

    @torch.library.custom_op("test_guide_words::plain", mutates_args=())
    def plain(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @torch.library.custom_op("test_guide_words::with_backward", mutates_args=())
    def with_backward(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    with_backward.register_autograd(lambda ctx, grad: grad)
    has_key = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has_key("test_guide_words::plain", "Autograd")  # why the key misleads
    backend = registry.Backend(
        "with-and-without",
        operators={
            "knn": "test_guide_words::plain",
            "knn_aggregate": "test_guide_words::with_backward",
        },
    )
    assert not backend.has_autograd("knn")
    assert backend.has_autograd("knn_aggregate")
    with pytest.raises(ValueError, match="^op: 'with-and-without' has custom"):
        backend.has_autograd("radius_aggregate")


def test_has_autograd_reads_a_cpp_operator_from_the_dispatcher():
    """An operator defined in C++ has an Autograd kernel only once
    ``register_autograd`` gave it one: chapter 11's aggregation has one, its replay
    of the search's work none."""
    fused = registry.get("fused")
    if not fused.available():
        pytest.skip("fused: its operators need a C++ toolchain to be built")
    assert fused.has_autograd("knn_aggregate")
    replay = registry.Backend(
        "replay", operators={"knn": "extkernels_fused::knn_work"}, prepare=fused.prepare
    )
    assert not replay.has_autograd("knn")


@pytest.mark.parametrize(
    "situation", [s for s, (_, op) in ROWS.items() if op is not None]
)
def test_the_guide_says_autograd_iff_the_operator_has_one(situation, table):
    backend, operation = ROWS[situation]
    b = registry.get(backend)
    if backend in ("cpp", "fused") and not b.available():
        pytest.skip(f"{backend}: its operators need a C++ toolchain to be built")
    registered = b.has_autograd(operation)
    use = table[0].loc[situation, "use"]
    assert ("autograd" in use) == registered, (
        f"{situation!r}: the guide says {use!r}, but {backend}'s operator "
        f"{'has' if registered else 'has no'} autograd formula"
    )


def test_the_brute_force_row_names_no_autograd_formula(table):
    (situation,) = [s for s, (_, op) in ROWS.items() if op is None]
    assert "autograd" not in table[0].loc[situation, "use"]


def test_the_guide_names_the_search_the_cuml_operator_runs(table):
    schema = torch.ops.cuml.knn.default._schema
    (algorithm,) = [a.default_value for a in schema.arguments if a.name == "algorithm"]
    assert algorithm == cuml.DEFAULT_ALGORITHM == "rbc"
    (situation,) = [s for s, (b, _) in ROWS.items() if b == "cuml"]
    assert cuml.SEARCHES[algorithm] in table[0].loc[situation, "use"]
    cells = [str(v) for v in table[0].to_numpy().ravel()] + list(
        guide.GLOSSARY.values()
    )
    for cell in cells:
        if "cuML" in cell:
            assert "brute" not in cell, f"the guide calls cuML's search brute: {cell!r}"


def test_at_least_claims_round_down_and_at_most_claims_round_up(table):
    text = table[0].loc["kNN in a training loop, any cloud", "on real geometry"]
    least = int(re.search(r"(\d+)× cuML or more", text).group(1))
    assert least <= results.tree_times(table[1])["x cuml at 10⁶"].min()
    most = float(re.search(r"at most ([\d.]+) ms", text).group(1))
    assert most >= results.tree_times(table[1])["ms at 10⁶"].max()
    assert results.at_least(20.543) == "20" and results.at_most(1.131, 2) == "1.14"
    assert results.at_most(1.32, 2) == "1.32"


def test_worst_cases_round_up_and_ranges_enclose_the_runs(table):
    words, times = table[0]["on real geometry"], table[1]
    at_1e6 = results.at_size(times, 1_000_000, ["fused-grid", "triton", "cuml"])
    for situation, method in (
        ("kNN on clouds known to be blobs", "fused-grid"),
        ("kNN without a C++ toolchain", "triton"),
    ):
        quoted = re.search(r"up to ([\d,]+) ms", words[situation]).group(1)
        assert float(quoted.replace(",", "")) >= at_1e6[method].max(), situation
    lo, hi = re.search(r"(\d+) to (\d+) ms", words[_CUML]).groups()
    assert float(lo) <= at_1e6["cuml"].min() and float(hi) >= at_1e6["cuml"].max()
    warp = results.radius_times(times)["warp-radius / normal"].drop("normal").max()
    quoted = re.search(r"up to ([\d.]+)×", words[_WARP]).group(1)
    assert float(quoted) >= warp


_CUML = "A kNN library you already use (cuML)"
_WARP = "Radius neighbourhoods, Warp already in your stack"


def test_no_cell_of_the_guide_names_the_books_cloud_as_its_own_worst(table):
    cells = [str(v) for v in table[0].to_numpy().ravel()]
    assert not [c for c in cells if "(normal)" in c]


def _pages() -> list[Path]:
    return [
        ROOT / f"{f}{ext}"
        for f in toc_files()
        for ext in (".ipynb", ".md")
        if (ROOT / f"{f}{ext}").exists()
    ]


@pytest.mark.parametrize("path", _pages(), ids=lambda p: p.name)
def test_no_page_calls_cumls_search_a_brute_force(path):
    if path.suffix == ".md":
        texts = [path.read_text()]
    else:
        nb = nbformat.read(path, as_version=4)
        texts = [c.source for c in nb.cells]
    found = [
        m.group(0)
        for t in texts
        for m in re.finditer(r"cuML's brute[- ]force[^.\n]*", t, re.I)
    ]
    assert not found, (
        f"{path.name}: the book's cuML operator runs {cuml.DEFAULT_ALGORITHM!r}, not "
        f"'brute': {found}"
    )


@pytest.mark.parametrize(
    "ratios, expected",
    [
        ({"normal": 1.0, "panda": 0.8, "shell": 0.9}, "is no slower on any cloud"),
        ({"normal": 1.0, "panda": 1.31, "shell": 0.9}, "takes at most 1.4× its time"),
    ],
)
def test_a_method_against_the_books_cloud_names_its_slowest_other_cloud(
    ratios, expected
):
    text = results.against_book_cloud(pd.Series(ratios))
    assert text.startswith(expected), text
    assert "normal" not in text
    assert ("panda" in text) == (max(ratios.values()) > 1.0)


def test_the_fused_rows_quote_the_just_in_time_build_from_the_shipping_file():
    _, bench = results.load(DATA / "benchmark-h200.json")
    _, clouds = results.load(DATA / "benchmark-clouds-h200.json")
    _, times, _ = geometry.load(DATA / "geometry-h200.json")
    _, shipping = results.load(DATA / "benchmark-shipping-h200.json")
    assert guide.jit_variant(shipping, "fused") == "knn/fused+graphs+jit"
    assert guide.jit_variant(shipping, "cpp") is None  # its +aoti loads a package
    assert guide.jit_variant(None, "fused") is None
    jit = shipping.loc[guide.jit_variant(shipping, "fused"), "first_call_s"]
    costs = guide.guide(bench, clouds, times, shipping)["cost"]
    fused = [s for s, (backend, _) in ROWS.items() if backend == "fused"]
    for situation in fused:
        assert f"without the prebuilt wheel, {jit:.1f} s" in costs[situation]
    others = costs.drop(fused)
    assert not others.str.contains("prebuilt wheel").any()
    # without the shipping file the guide says nothing of a build it did not read
    plain = guide.guide(bench, clouds, times)["cost"]
    assert not plain.str.contains("prebuilt wheel").any()


def test_the_glossary_says_what_its_variants_share():
    # Each option's words must hold for every variant that carries it, whatever its
    # backend (the floor carries +1thread too).
    from extkernels import variants

    def carrying(part):
        return [v for v in variants.VARIANTS if part in v.name]

    one_thread = carrying("+1thread")
    assert one_thread and not any(v.backward_thread for v in one_thread)
    if len({v.backend for v in one_thread}) > 1:
        assert "Warp" not in guide.GLOSSARY["+1thread"], guide.GLOSSARY["+1thread"]
    words = guide.GLOSSARY["warp-saved, warp-manual"]
    assert all(v.options.get("handover") == "saved" for v in carrying("warp-saved"))
    assert all(v.options.get("backward") == "manual" for v in carrying("warp-manual"))
    assert "ctx" in words and "by hand" in words and "tape" not in words, words
