"""The book's prose: short chapters with a frame, few glued numbers, and the operator
chapters' registrations typed in cells the reader runs (not shown from the package).

Prose is the text of the markdown cells (of a ``.md`` page, the whole page) without
fenced blocks (code, directives) and HTML comments, counted in whitespace-separated
words, as a reader meets it."""

import re
from collections import Counter
from pathlib import Path

import nbformat
import pytest
from conftest import ROOT, toc_files

MAX_CHAPTER_WORDS = 1_500
MAX_BOOK_WORDS = 16_000
MAX_GLUED = 20
MAX_SUMMARY_BULLETS = 5

# chapter -> the registration calls its input cells make, in the order typed
OPERATOR_CHAPTERS = {
    "03_cuml_knn": ("custom_op", "register_fake", "opcheck", "fullgraph=True"),
    "05_warp_radius": ("custom_op", "register_fake", "opcheck", "fullgraph=True"),
    "06_warp_backward": (
        "custom_op",
        "register_fake",
        "setup_context",
        "register_autograd",
        "opcheck",
        "fullgraph=True",
    ),
    "08_triton_knn": (
        "register_fake",
        "triton_op",
        "wrap_triton",
        "register_autograd",
        "opcheck",
        "fullgraph=True",
    ),
    "09_cuda_knn": (
        "TORCH_LIBRARY",
        "load_inline",
        "register_fake",
        "register_autograd",
        "opcheck",
        "fullgraph=True",
    ),
    "10_ptx_gather": (
        "custom_op",
        "register_fake",
        "register_autograd",
        "opcheck",
        "fullgraph=True",
    ),
    "14_real_clouds": ("custom_op", "register_fake", "opcheck", "fullgraph=True"),
    "15_shipping": ("custom_op", "register_fake", "opcheck", "fullgraph=True"),
    "16_your_model": (
        "custom_op",
        "register_fake",
        "new_dynamic_size",
        "register_autograd",
        "opcheck",
        "fullgraph=True",
        "torch.export.export",
    ),
}

BLOCK = re.compile(r"(^(?:`{3,}|:{3,}).*?^(?:`{3,}|:{3,})\s*$)", re.S | re.M)
ADMONITION = re.compile(
    r"^(`{3,}|:{3,})\{(note|tip|important|warning|admonition|seealso)"
)
COMMENT = re.compile(r"<!--.*?-->", re.S)
GLUE = re.compile(r"\{glue(?::[a-z]+)?\}`")


def _pages() -> list[Path]:
    pages = []
    for f in toc_files():
        for ext in (".ipynb", ".md"):
            if (ROOT / f"{f}{ext}").exists():
                pages.append(ROOT / f"{f}{ext}")
    return pages


def markdown(path: Path) -> list[str]:
    """The markdown of a page, one string per markdown cell."""
    if path.suffix == ".md":
        return [path.read_text()]
    nb = nbformat.read(path, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "markdown"]


def prose(text: str) -> str:
    """The prose of some markdown: fenced code and directives dropped, the bodies of
    admonitions (``:::{note}``) kept without their option lines."""
    kept = []
    for block in BLOCK.split(COMMENT.sub("", text)):
        if ADMONITION.match(block):
            body = block.splitlines()[1:-1]
            kept.append("\n".join(line for line in body if not line.startswith(":")))
        elif not BLOCK.match(block):
            kept.append(block)
    return "\n".join(kept)


def words(path: Path) -> int:
    return sum(len(prose(m).split()) for m in markdown(path))


def glued(path: Path) -> int:
    return sum(len(GLUE.findall(prose(m))) for m in markdown(path))


PAGES = _pages()
CHAPTERS = [p for p in PAGES if re.match(r"\d\d_", p.name)]


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_a_page_is_short_and_quotes_few_glued_numbers(path):
    n, g = words(path), glued(path)
    assert n <= MAX_CHAPTER_WORDS, (
        f"{path.name}: {n} words of prose, at most {MAX_CHAPTER_WORDS}: tables carry "
        "the numbers; what was tried and lost goes to the design notes"
    )
    assert g <= MAX_GLUED, (
        f"{path.name}: {g} glued values in its prose, at most {MAX_GLUED}: a sentence "
        "with three glued numbers is a table waiting to happen"
    )


def test_the_book_is_short():
    per_page = {p.name: words(p) for p in PAGES}
    total = sum(per_page.values())
    assert total <= MAX_BOOK_WORDS, (
        f"{total} words of prose in the book, at most {MAX_BOOK_WORDS}: {per_page}"
    )


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_a_chapter_opens_with_what_you_will_learn_and_closes_with_a_summary(path):
    cells = markdown(path)
    opening = prose(cells[0])
    assert "What you will learn" in opening, f"{path.name}: no 'What you will learn'"
    assert "Prerequisites" in opening, f"{path.name}: no prerequisites in its opening"
    learn = opening.split("What you will learn", 1)[1].split("Prerequisites", 1)[0]
    bullets = len(re.findall(r"^\s*[-*] ", learn, re.M))
    assert 3 <= bullets <= 5, f"{path.name}: {bullets} bullets to learn, 3 to 5"
    closing = cells[-1]
    assert re.search(r"^#+ Summary", closing, re.M), (
        f"{path.name}: its last markdown cell is not a '## Summary'"
    )
    n = len(re.findall(r"^\s*[-*] ", closing.split("Summary", 1)[1], re.M))
    assert 1 <= n <= MAX_SUMMARY_BULLETS, f"{path.name}: {n} summary bullets"


@pytest.mark.parametrize("name", OPERATOR_CHAPTERS)
def test_operator_chapters_type_their_registration(name):
    nb = nbformat.read(ROOT / "book" / f"{name}.ipynb", as_version=4)
    typed = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    calls = OPERATOR_CHAPTERS[name]
    missing = [c for c in calls if c not in typed]
    assert not missing, f"{name}: no input cell calls {missing}"
    order = [typed.index(c) for c in calls]
    assert order == sorted(order), (
        f"{name}: the registration is typed out of order (expected {calls})"
    )


@pytest.mark.parametrize("name", OPERATOR_CHAPTERS)
def test_the_registration_is_not_shown_from_the_package(name):
    nb = nbformat.read(ROOT / "book" / f"{name}.ipynb", as_version=4)
    listings = [
        c
        for c in nb.cells
        if c.cell_type == "code" and re.search(r"show_(source|listing|cpp)\(", c.source)
    ]
    shown = "\n".join(
        o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
        for c in listings
        for o in c.get("outputs", [])
    )
    for call in ("register_fake", "register_autograd", "TORCH_LIBRARY("):
        assert call not in shown, (
            f"{name}: a package listing shows {call}: the reader types the registration"
        )
    assert len(listings) <= 2, (
        f"{name}: {len(listings)} package listings, at most two (long kernels)"
    )


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_prose_says_what_is_so_now(path):
    text = "\n".join(prose(m) for m in markdown(path))
    stale = [
        phrase
        for phrase in (
            "H100",
            "timed before",
            "earlier runs",
            "before that change",
            "committed",
            "tried and lost",
        )
        if phrase in text
    ]
    if path.stem == "design_notes":
        stale = [s for s in stale if s not in ("tried and lost",)]
    assert not stale, f"{path.name}: lab-notebook phrasing {stale}"


#: A number as a measurement reads: three decimals (0.282 ms) or a decimal ratio (2.2×).
TYPED_MEASUREMENT = re.compile(r"(?<![\w.`$])(\d+\.\d{3}\b|\d+\.\d+\s?×)")


def typed_measurements(text: str) -> list[str]:
    """Numbers in ``text`` that read as measurements, outside glue roles: a figure the
    prose quotes must come from the data files through glue, where nbval compares it."""
    text = re.sub(r"\{glue[^}]*\}`[^`]*`|\$[^$]*\$", "", prose(text))  # glue, math
    return TYPED_MEASUREMENT.findall(text)


def test_the_typed_measurement_rule_sees_one():
    assert typed_measurements("took 0.282 ms, 2.2× faster") == ["0.282", "2.2×"]
    assert typed_measurements("{glue:text}`x:.3f` ms, 0.28 ms goal, 8×, $0.002$") == []


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_prose_types_no_measurement(path):
    typed = [t for m in markdown(path) for t in typed_measurements(m)]
    assert not typed, f"{path.name}: typed figures {typed}; glue them from the data"


# ------------------------------------------------------------ no generated verdicts

#: Words of a judgement: a glued value holding one is a sentence the code wrote; so is
#: any glued text of five words or more, unless it quotes an error the page ran into.
VERDICT = re.compile(r"\b(faster|slower|within the|goals?|targets?|meets|misses)\b")
ERROR = re.compile(r"^['\"]?\w*(Error|Exception|Unsupported)\b")
GLUE_KEY = re.compile(r"\{glue(?::[a-z]+)?\}`([A-Za-z0-9_]+)")
RECORD = "application/papermill.record/text/plain"


def glue_records(path: Path) -> list[tuple[str, str]]:
    """The ``(name, value)`` a notebook glued, in order, as stored (the value's
    ``text/plain`` form)."""
    return [
        (out.get("metadata", {}).get("scrapbook", {}).get("name"), out["data"][RECORD])
        for cell in nbformat.read(path, as_version=4).cells
        for out in (cell.get("outputs", []) if cell.cell_type == "code" else [])
        if RECORD in out.get("data", {})
    ]


def glued_values(path: Path) -> dict[str, str]:
    """The values a notebook glued, by name (the last, where one is glued twice)."""
    return dict(glue_records(path))


def written(value: str) -> bool:
    """Whether a glued value is a judgement, or a sentence that is not an error."""
    sentence = value[:1] in "'\"" and len(value.split()) >= 5
    return bool(VERDICT.search(value)) or (sentence and not ERROR.match(value))


def verdicts_in_prose(path: Path) -> list[str]:
    values = glued_values(path)
    keys = {k for m in markdown(path) for k in GLUE_KEY.findall(prose(m))}
    return sorted(
        f"{k} = {values[k]}" for k in keys if k in values and written(values[k])
    )


@pytest.mark.parametrize("path", [p for p in PAGES if p.suffix == ".ipynb"], ids=str)
def test_prose_quotes_numbers_and_names_never_verdicts(path):
    # A person writes what a table shows; the code glues numbers and names only.
    found = verdicts_in_prose(path)
    assert not found, f"{path.name}: the prose quotes a generated judgement: {found}"


def _glued(name: str, value: str) -> nbformat.NotebookNode:
    """A code cell whose stored output is myst-nb's record of ``glue(name, value)``."""
    cell = nbformat.v4.new_code_cell("glue(...)")
    cell.outputs = [
        nbformat.v4.new_output(
            "display_data",
            data={RECORD: value},
            metadata={"scrapbook": {"name": name}},
        )
    ]
    return cell


def test_the_verdict_rule_sees_one(tmp_path):
    nb = nbformat.v4.new_notebook()
    glue = _glued("x_vs_y", "'faster than'")
    said = _glued("said", "'The walk stays close on every cloud'")
    text = "X is {glue:text}`x_vs_y` Y. {glue:text}`said`."
    nb.cells = [glue, said, nbformat.v4.new_markdown_cell(text)]
    path = tmp_path / "page.ipynb"
    nbformat.write(nb, path)
    assert verdicts_in_prose(path) == [
        "said = 'The walk stays close on every cloud'",
        "x_vs_y = 'faster than'",
    ]


def generated_judgements(path: Path) -> list[str]:
    """Every value a page glues (quoted or not) that is a judgement or a sentence."""
    return sorted(f"{k} = {v}" for k, v in glued_values(path).items() if written(v))


@pytest.mark.parametrize("path", [p for p in PAGES if p.suffix == ".ipynb"], ids=str)
def test_no_page_glues_a_judgement(path):
    found = generated_judgements(path)
    assert not found, f"{path.name}: the code glues judgements: {found}"


def glue_counts(path: Path) -> dict[str, int]:
    """How many stored outputs glue each name on a page."""
    return dict(Counter(name for name, _ in glue_records(path)))


@pytest.mark.parametrize("path", [p for p in PAGES if p.suffix == ".ipynb"], ids=str)
def test_a_number_quoted_twice_comes_from_one_value(path):
    # Each glued name is stored once: wherever the prose quotes it, it reads one value.
    twice = {k: n for k, n in glue_counts(path).items() if n > 1}
    assert not twice, f"{path.name}: names glued more than once: {twice}"


def test_the_glue_count_sees_a_name_glued_twice(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [_glued("ms", "0.5"), _glued("ms", "0.6"), _glued("other", "1")]
    nbformat.write(nb, tmp_path / "page.ipynb")
    assert glue_counts(tmp_path / "page.ipynb") == {"ms": 2, "other": 1}
