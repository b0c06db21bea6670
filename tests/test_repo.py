"""House rules of the repository: lint, canonical notebooks, small committed files."""

import re
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
    for args in (
        ["check", "src", "tests", "book"],
        ["format", "--check", "src", "tests"],
    ):
        result = subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, (
            f"ruff {' '.join(args)}:\n{result.stdout}{result.stderr}"
        )


# ruff's line length, which the website's listings are laid out for
LINE_LENGTH = int(
    re.search(r"^line-length = (\d+)", (ROOT / "pyproject.toml").read_text(), re.M)[1]
)


def _code_cells(path: Path) -> list[tuple[int, nbformat.NotebookNode]]:
    """The code cells of a notebook with their indices."""
    nb = nbformat.read(path, as_version=4)
    return [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_code_lines_fit_the_page(path):
    long = [
        f"cell {i}: {len(line)} characters: {line.strip()[:50]}"
        for i, cell in _code_cells(path)
        for line in cell.source.splitlines()
        if len(line) > LINE_LENGTH
    ]
    assert not long, f"{path.name}: code lines over {LINE_LENGTH} characters:\n" + (
        "\n".join(long)
    )


# the longest code cell a page shows; a longer one folds (or removes) its input
MAX_VISIBLE_CELL_LINES = 15
HIDING_TAGS = {"hide-input", "remove-input", "remove-cell", "hide-cell"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_visible_code_cells_are_short(path):
    long = [
        f"cell {i}: {n} lines: {cell.source.strip().splitlines()[0][:50]}"
        for i, cell in _code_cells(path)
        if not HIDING_TAGS & set(cell.metadata.get("tags", []))
        and (n := len(cell.source.rstrip().splitlines())) > MAX_VISIBLE_CELL_LINES
    ]
    assert not long, (
        f"{path.name}: visible code cells over {MAX_VISIBLE_CELL_LINES} lines (tag "
        "the input hide-input, or shorten the cell):\n" + "\n".join(long)
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_valid_and_canonical(path):
    text = path.read_text()
    nb = nbformat.reads(text, as_version=4)
    nbformat.validate(nb)
    assert nbformat.writes(nb) + "\n" == text or nbformat.writes(nb) == text, (
        f"{path.name} is not in canonical nbformat: load and save it with "
        "nbformat.write"
    )
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", (
        f"{path.name}: kernel must be python3"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_glued_values_are_plain_python(path):
    # myst-nb formats a glued number from its text/plain form: a NumPy scalar's form
    # (np.float64(...)) cannot be formatted, and the website build fails.
    nb = nbformat.read(path, as_version=4)
    bad = [
        o["metadata"]["scrapbook"]["name"]
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if "scrapbook" in o.get("metadata", {})
        and any(
            str(v).startswith("np.")
            for k, v in o.get("data", {}).items()
            if "text/plain" in k
        )
    ]
    assert not bad, f"{path.name}: glue a float() or int(), not a NumPy scalar: {bad}"


#: Calls that read the book's committed data files (the benchmark's, chapter 14's
#: geometry and traits, chapter 13's distributed runs, chapter 16's batched runs).
DATA_READERS = re.compile(
    r"\b(results\.(recorded|load)|(geometry|report|traits|batched)\.load)\("
)


def _reads_data(cell) -> bool:
    return (
        cell.cell_type == "code"
        and DATA_READERS.search(cell.source) is not None
        # The guide also counts the backends' source lines: a change of code, not of
        # data, changes it.
        and "guide.guide(" not in cell.source
        # nbval shows a figure returned by a cell twice: compared by no test.
        and "plotting." not in cell.source
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_what_a_page_reads_from_the_data_files_is_compared_under_nbval(path):
    """A cell that reads a committed data file shows the same output on any machine:
    CI re-executes it on the CPU and compares it with the stored one
    (``nbval-check-output``), so a page that quotes a file it was not executed against
    fails."""
    nb = nbformat.read(path, as_version=4)
    unchecked = [
        i
        for i, cell in enumerate(nb.cells)
        if _reads_data(cell)
        and "nbval-check-output" not in cell.metadata.get("tags", [])
    ]
    assert not unchecked, (
        f"{path.name}: cells {unchecked} read a data file: tag them nbval-check-output"
    )


def test_the_data_rule_sees_the_pages_that_read_files():
    reading = {
        p.stem for p in NOTEBOOKS for c in nbformat.read(p, 4).cells if _reads_data(c)
    }
    assert {"01_eager_baseline", "13_distributed", "14_real_clouds", "results"} <= (
        reading
    )


# tags under which a cell's stderr stays off the page
QUIET_TAGS = {"remove-stderr", "remove-output", "remove-cell"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_stderr_reaches_the_page(path):
    # Warnings and logs (cuBLAS contexts, inductor's cudagraph notes, profiler lines)
    # are the machine's, not the lesson: what a cell shows is its result.
    loud = [
        f"cell {i}: {o.text.strip().splitlines()[0][:60]}"
        for i, cell in _code_cells(path)
        if not QUIET_TAGS & set(cell.metadata.get("tags", []))
        for o in cell.get("outputs", [])
        if o.get("output_type") == "stream" and o.get("name") == "stderr"
    ]
    assert not loud, f"{path.name}: stderr on the page (tag remove-stderr):\n" + (
        "\n".join(loud)
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executed_in_order(path):
    nb = nbformat.read(path, as_version=4)
    counts = [
        c.execution_count
        for c in nb.cells
        if c.cell_type == "code" and c.source.strip()
    ]
    assert None not in counts, f"{path.name}: some code cells were never executed"
    assert counts == sorted(counts), f"{path.name}: cells were executed out of order"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_captioned_cells_store_their_figure(path):
    # A cell with a figure caption must store its PNG (or a "skipped" message), as the
    # execution command demands: without it the page shows a caption under nothing.
    from extkernels.execute import missing_figures

    missing = missing_figures(nbformat.read(path, as_version=4))
    assert not missing, (
        f"{path.name}: captioned cells {missing} store no image/png and no 'skipped' "
        "message; re-execute the chapter"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_captioned_cells_show_only_their_figure(path):
    # myst-nb makes every displayed output of a captioned cell a figure of that name
    from extkernels.execute import crowded_figures

    crowded = crowded_figures(nbformat.read(path, as_version=4))
    assert not crowded, (
        f"{path.name}: captioned cells {crowded} display more than their figure; "
        "show the table from a cell of its own and re-execute the chapter"
    )


def test_committed_files_are_small():
    big = [
        (f.relative_to(ROOT), f.stat().st_size)
        for f in _tracked_files()
        if f.exists() and f.stat().st_size > MAX_FILE_BYTES
    ]
    assert not big, f"files over {MAX_FILE_BYTES // 2**20} MiB: {big}"


# ---------------------------------------------------------------- requirements

#: CUDA major of the default PyPI wheel of packages whose name does not say it (Linux
#: x86-64): torch 2.13.0's default wheel is its CUDA 13.0 build, Warp's PyPI wheels are
#: CUDA 13 builds.
DEFAULT_WHEEL_CUDA = {"torch": 13, "warp-lang": 13}


def _requirement_lines(path: Path) -> list[str]:
    """The requirement lines of a file and of the files it includes with ``-r``."""
    lines = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith(("-r ", "--requirement ")):
            lines += _requirement_lines(path.parent / line.split(maxsplit=1)[1])
        elif line:
            lines.append(line)
    return lines


def cuda_majors(path: Path) -> dict[int, list[str]]:
    """CUDA major -> the lines of ``path`` (includes followed) that pull a build of
    it."""
    found: dict[int, list[str]] = {}
    for line in _requirement_lines(path):
        name = re.split(r"[=<>!~@\[; ]", line, maxsplit=1)[0].lower()
        majors = {
            int(m) for m in re.findall(r"(?:-cu|cuda|\+cu|/whl/cu)(\d\d)", line.lower())
        }
        majors = {m // 10 if m > 20 else m for m in majors}  # cu128 -> 12, cu12 -> 12
        if not majors and name in DEFAULT_WHEEL_CUDA:
            majors = {DEFAULT_WHEEL_CUDA[name]}
        for m in majors:
            found.setdefault(m, []).append(line)
    return found


REQUIREMENTS = sorted(ROOT.glob("requirements*.txt"))


@pytest.mark.parametrize("path", REQUIREMENTS, ids=lambda p: p.name)
def test_no_requirements_file_mixes_cuda_majors(path):
    majors = cuda_majors(path)
    assert len(majors) <= 1, f"{path.name} mixes CUDA majors: {majors}"


def test_each_gpu_requirements_file_is_the_major_it_names():
    assert set(cuda_majors(ROOT / "requirements-cu12.txt")) == {12}
    assert set(cuda_majors(ROOT / "requirements-cu13.txt")) == {13}
    # the CPU file carries no RAPIDS library, so CI installs nothing it cannot use
    assert not any(
        "cuml" in line for line in _requirement_lines(ROOT / "requirements.txt")
    )


def test_the_mixing_check_sees_a_mixed_file(tmp_path):
    mixed = tmp_path / "requirements-mixed.txt"
    mixed.write_text("torch==2.13.0\ncuml-cu12==26.10.*\n")
    assert set(cuda_majors(mixed)) == {12, 13}


# ------------------------------------------------------- listings in the chapters


def _listings() -> list:
    """``(notebook, cell, expression, stored text)`` of every ``show_source(...)``
    cell."""
    found = []
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            m = re.search(r"show_source\(([\w.]+)\)", cell.source)
            if cell.cell_type == "code" and m:
                stored = "".join(
                    o["data"]["text/plain"] for o in cell.outputs if "data" in o
                )
                found.append(
                    pytest.param(
                        path.name, i, m.group(1), stored, id=f"{path.stem}-{i}"
                    )
                )
    return found


@pytest.mark.parametrize("name, cell, expression, stored", _listings())
def test_stored_listings_show_the_package_as_it_is(name, cell, expression, stored):
    # A chapter's listing of package code is an output: it must be re-executed when the
    # code changes, or the page shows code that no longer exists.
    import inspect

    pytest.importorskip("warp")
    import extkernels as ek
    from extkernels import graphs
    from extkernels.experiments import warp_interop as wi
    from extkernels.notebook import decorated
    from extkernels.ops import warp as warp_backend
    from extkernels.ops.warp import interop, kernels, saved
    from extkernels.ops.warp import ops as warp_ops

    names = {"ek": ek, "graphs": graphs, "wi": wi, "warp_backend": warp_backend}
    names.update(interop=interop, kernels=kernels, warp_ops=warp_ops, saved=saved)
    if name.startswith("08_"):  # chapter 8 names the Triton modules as it imports them
        from extkernels.ops.triton import kernels as triton_kernels
        from extkernels.ops.triton import ops as triton_ops
        from extkernels.ops.triton import spatial

        names.update(kernels=triton_kernels, ops=triton_ops, spatial=spatial)
    if name.startswith("09_"):  # chapter 9 names the C++ backend and its build
        from extkernels.ops import cpp
        from extkernels.ops.cpp import build

        cpp.prepare()  # its Python half (cpp.ops) exists once the library is loaded
        names.update(cpp=cpp, build=build)
    if name.startswith("11_"):  # chapter 11 names its experiments and the fused build
        from extkernels.experiments import whole_step
        from extkernels.ops.fused import build

        names.update(whole_step=whole_step, build=build)
    if name.startswith("14_"):  # chapter 14 names the fused backend's Python half
        from extkernels.ops import fused

        fused.prepare()
        from extkernels.ops.fused import ops as fused_ops

        names.update(fused_ops=fused_ops)
    if name.startswith("13_"):  # chapter 13 names the distributed layer's modules
        from extkernels.distributed import ops as dops
        from extkernels.distributed import shards
        from extkernels.distributed.setups import Setup

        names.update(dops=dops, shards=shards, Setup=Setup)
    if name.startswith("10_"):  # chapter 10 names the PTX backend's modules
        from extkernels.ops.ptx import kernels as ptx_kernels
        from extkernels.ops.ptx import ops as ptx_ops

        names.update(kernels=ptx_kernels, ops=ptx_ops)
    obj = eval(expression, names)
    source = inspect.getsource(decorated(obj))
    assert source.rstrip() == stored.rstrip(), (
        f"{name}, cell {cell}: the listing of {expression} is not the package's code "
        "any more; re-execute the chapter"
    )


def _cpp_listings() -> list:
    """``(notebook, cell, listings, stored texts)`` of every cell that calls
    ``show_cpp``: its ``(file, start)`` pairs and its outputs' texts, in order."""
    found = []
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            listings = re.findall(
                r'show_cpp\(build\.CSRC / "([\w.]+)", "([^"]+)"\)', cell.source
            )
            if cell.cell_type == "code" and listings:
                stored = [
                    "".join(o["data"]["text/plain"])
                    for o in cell.outputs
                    if "data" in o
                ]
                found.append(
                    pytest.param(path.name, i, listings, stored, id=f"{path.stem}-{i}")
                )
    return found


@pytest.mark.parametrize("name, cell, listings, stored", _cpp_listings())
def test_stored_cpp_listings_show_the_sources_as_they_are(name, cell, listings, stored):
    # The C++ listings are outputs too: a changed source needs the chapter re-executed.
    from extkernels.notebook import cpp_excerpt
    from extkernels.ops.cpp.build import CSRC

    if name.startswith(("11_", "14_")):  # chapters 11, 14: the fused backend's sources
        from extkernels.ops.fused.build import CSRC
    assert len(stored) == len(listings), (
        f"{name}, cell {cell}: {len(listings)} listings called, {len(stored)} stored"
    )
    for (file, start), text in zip(listings, stored, strict=True):
        assert text.strip(), f"{name}, cell {cell}: no stored listing of {file}"
        assert cpp_excerpt(CSRC / file, start).rstrip() == text.rstrip(), (
            f"{name}, cell {cell}: the listing of {file} ({start}) is not the source "
            "any more; re-execute the chapter"
        )


def test_no_chapter_lists_a_registration_from_the_package():
    # the reader types every registration (custom_op, register_fake, register_autograd)
    listed = [
        f"{path.name}, cell {i}"
        for path in NOTEBOOKS
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells)
        if cell.cell_type == "code" and "show_listing(" in cell.source
    ]
    assert not listed, f"registrations shown from the package: {listed}"


def test_no_page_times_a_benchmark_variant_again():
    """A variant the benchmark command times has one figure in the book: a page reads
    the campaign's runs (``results.recorded``) and never times the variant itself."""
    again = [
        f"{path.name} cell {i}"
        for path in NOTEBOOKS
        for i, cell in _code_cells(path)
        if re.search(r"\b(benchmark\.run_all|variants\.run)\(", cell.source)
    ]
    assert not again, "pages time benchmark variants again: " + ", ".join(again)
