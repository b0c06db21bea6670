"""The prose's comparisons of measured rows, each tied to its sentence.

A page reads timings from ``book/data/benchmark-h200.json`` (chapter 16 from
``batched-h200.json``) and a person writes what they show: which runs overlap, which
are apart, which median is longer. When a file is measured again, a sentence that no
longer reads what the runs show fails here. Each check names the words of its sentence,
which must still stand on the page: a sentence rewritten takes its check along.

Ranges are a variant's fastest to slowest run (``*_min`` .. ``*_max``), medians its
``*_ms``; ``forward`` is the forward pass, ``train`` the training step, and a search
of chapter 16's file (its rows ``"case: method"``) is read as a forward pass."""

import io
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass

import nbformat
import pandas as pd
import pytest
from conftest import ROOT

from extkernels import results, timing
from extkernels.experiments import batched

BENCHMARK = ROOT / "book" / "data" / "benchmark-h200.json"
BATCHED = ROOT / "book" / "data" / "batched-h200.json"
MACHINES = ROOT / "book" / "data" / "machines-h200.json"
BOTH = ("forward", "train")
#: A search of chapter 16's file, one call timed like a forward pass.
SEARCH = "forward"


def _pair(t: pd.DataFrame, a: str, b: str, metric: str) -> pd.Series:
    """:func:`extkernels.timing.compare` of ``a`` against ``b``: ``"a / b"`` (of the
    medians) and ``"ranges overlap"``."""
    return timing.compare(t, {"claim": (a, b)}, metric).loc["claim"]


def overlap(t: pd.DataFrame, a: str, b: str, *metrics: str) -> bool:
    """Whether the runs of ``a`` and ``b`` overlap in every one of ``metrics``."""
    return all(_pair(t, a, b, m)["ranges overlap"] for m in metrics)


def below(t: pd.DataFrame, a: str, b: str, *metrics: str) -> bool:
    """Whether every run of ``a`` is shorter than every run of ``b``, in every one of
    ``metrics``: the ranges apart, ``a``'s median the shorter."""
    pairs = [_pair(t, a, b, m) for m in metrics]
    return all(not p["ranges overlap"] and p["a / b"] < 1 for p in pairs)


def longer(t: pd.DataFrame, a: str, b: str, metric: str) -> bool:
    """Whether the median of ``a`` is longer than that of ``b``."""
    return _pair(t, a, b, metric)["a / b"] > 1


def within(t: pd.DataFrame, a: str, b: str, share: float, *metrics: str) -> bool:
    """Whether the medians of ``a`` and ``b`` differ by less than ``share`` of
    ``b``'s."""
    return all(abs(_pair(t, a, b, m)["a / b"] - 1) < share for m in metrics)


@dataclass(frozen=True)
class Claim:
    page: str
    words: str
    holds: Callable[[pd.DataFrame], bool]


RO = "radius/warp+reduce-overhead"
WARP_COMPILED = [
    "radius/warp+compile",
    "radius/warp-manual+compile",
    "radius/warp-saved+compile",
    "radius/warp+reduce-overhead",
]

#: The results page's two shortest kNN training steps, which it names by glue.
KNN_BEST, KNN_RUNNER_UP = "knn/fused+compile+graphs", "knn/cpp+graphs"


def ranked_first(t: pd.DataFrame, workload: str, best: str, runner_up: str) -> bool:
    """Whether ``best`` and ``runner_up`` are the workload's two shortest training
    steps, as the results page's glue ranks them."""
    quotes = results.variant_quotes(results.by_workload(t))
    pair = (quotes[f"{workload}_best"], quotes[f"{workload}_runner_up"])
    return pair == (best, runner_up)


CLAIMS = [
    Claim(
        "03_cuml_knn",
        "the direct call's runs and the operator's, eager or compiled, overlap",
        lambda t: (
            overlap(t, "knn/cuml", "knn/cuml-op", *BOTH)
            and overlap(t, "knn/cuml+compile", "knn/cuml-op+compile", *BOTH)
        ),
    ),
    Claim(
        "04_rmm_pool",
        "Every shared-pool forward pass is shorter than every one without a pool",
        lambda t: below(t, "knn/cuml-op+compile+rmm", "knn/cuml-op+compile", "forward"),
    ),
    Claim(
        "04_rmm_pool",
        "in the training step ({glue:text}`rmm_train_gain:.2f`×) the ranges overlap",
        lambda t: overlap(t, "knn/cuml-op+compile+rmm", "knn/cuml-op+compile", "train"),
    ),
    Claim(
        "04_rmm_pool",
        "the RAPIDS-only runs overlap the shared ones",
        lambda t: overlap(
            t, "knn/cuml-op+compile+rmm-rapids", "knn/cuml-op+compile+rmm", *BOTH
        ),
    ),
    Claim(
        "05_warp_radius",
        "Compiled, its median forward pass is longer than eager, the ranges "
        "overlapping",
        lambda t: (
            longer(t, "radius/warp+compile", "radius/warp", "forward")
            and overlap(t, "radius/warp+compile", "radius/warp", "forward")
        ),
    ),
    Claim(
        "06_warp_backward",
        "ms eager, the ranges overlapping",
        lambda t: overlap(t, "radius/warp+compile", "radius/warp", "train"),
    ),
    Claim(
        "06_warp_backward",
        "The hand-written scatter and the hand-over through `ctx` have longer medians "
        "than the pool's, ranges overlapping too.",
        lambda t: all(
            longer(t, v, "radius/warp+compile", "train")
            and overlap(t, v, "radius/warp+compile", "train")
            for v in ("radius/warp-manual+compile", "radius/warp-saved+compile")
        ),
    ),
    Claim(
        "06_warp_backward",
        "With `reduce-overhead` the step's runs overlap those of the default mode.",
        lambda t: overlap(t, "radius/warp+compile", RO, "train"),
    ),
    Claim(
        "06_warp_backward",
        "Every compiled variant's training-step range overlaps the eager one's.",
        lambda t: all(overlap(t, v, "radius/warp", "train") for v in WARP_COMPILED),
    ),
    Claim(
        "07_warp_interop",
        "Eager, every training run on the calling thread is shorter than every run on "
        "autograd's thread; compiled too",
        lambda t: (
            below(t, "radius/warp+1thread", "radius/warp", "train")
            and below(t, "radius/warp+compile+1thread", "radius/warp+compile", "train")
        ),
    ),
    Claim(
        "09_cuda_knn",
        "Eager, every run of the step is longer than every run of the floor",
        lambda t: below(t, "knn/floor", "knn/cpp", "train"),
    ),
    Claim(
        "09_cuda_knn",
        "ms, more than the step captured by hand",
        lambda t: longer(t, "knn/cpp+reduce-overhead", "knn/cpp+graphs", "train"),
    ),
    Claim(
        "10_ptx_gather",
        "In one CUDA graph the projector is within 2 % of chapter 9's",
        lambda t: within(t, "knn/ptx+graphs", "knn/cpp+graphs", 0.02, *BOTH),
    ),
    Claim(
        "10_ptx_gather",
        "Eager, its forward and training runs overlap chapter 9's",
        lambda t: overlap(t, "knn/ptx", "knn/cpp", *BOTH),
    ),
    Claim(
        "10_ptx_gather",
        "the compiled forward runs overlap the eager ones",
        lambda t: overlap(t, "knn/ptx", "knn/ptx+compile", "forward"),
    ),
    Claim(
        "results",
        "every training run of the first is shorter, every forward pass of the second",
        lambda t: (
            ranked_first(t, "knn", KNN_BEST, KNN_RUNNER_UP)
            and below(t, KNN_BEST, KNN_RUNNER_UP, "train")
            and below(t, KNN_RUNNER_UP, KNN_BEST, "forward")
        ),
    ),
]


def crossover(t: pd.DataFrame, below_size: int, above_size: int) -> bool:
    """Whether the brute force over the batch (``knn_batched``) beats a loop of tree
    searches on clouds up to ``below_size`` points, and the loop beats it from
    ``above_size``, every run apart (chapter 16's crossover rows, ``"crossover: 8 x
    4,096, fused, knn_batched"``)."""
    sizes = {
        int(m.group(1).replace(",", ""))
        for m in map(re.compile(r"crossover: \d+ x ([\d,]+), ").match, t.index)
        if m
    }
    batched = "crossover: 8 x {:,}, fused, knn_batched".format
    loop = "crossover: 8 x {:,}, fused, loop of clouds".format
    small = [below(t, batched(n), loop(n), SEARCH) for n in sizes if n <= below_size]
    large = [below(t, loop(n), batched(n), SEARCH) for n in sizes if n >= above_size]
    return bool(small) and bool(large) and all(small + large)


BATCHED_CLAIMS = [
    Claim(
        "16_your_model",
        "beats the tree search that `ek.knn` runs on one cloud",
        lambda t: below(t, "single: fused, knn_batched", "single: fused", SEARCH),
    ),
    Claim(
        "16_your_model",
        "the crossover rows place the turn between 4,096 and 16,384 points per cloud",
        lambda t: crossover(t, 4096, 16384),
    ),
]


def apart_machines(t: pd.DataFrame, *metrics: str) -> list[tuple[str, str]]:
    """The pairs of GPUs (rows of the machines file) whose runs do not overlap in every
    one of ``metrics``."""
    pairs = itertools.combinations(t.index, 2)
    return [(a, b) for a, b in pairs if not overlap(t, a, b, *metrics)]


MACHINE_CLAIMS = [
    Claim(
        "results",
        "Every GPU's runs overlap every other's, forward and in training",
        lambda t: len(t) > 1 and not apart_machines(t, *BOTH),
    ),
]


def stored_output(page: str, code: str) -> str:
    """The stored plain-text output of ``page``'s code cell whose source holds
    ``code`` (its first output of more than one line: a table)."""
    nb = nbformat.read(ROOT / "book" / f"{page}.ipynb", as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and code in cell.source:
            for out in cell.outputs:
                text = out.get("data", {}).get("text/plain", "")
                if "\n" in text:
                    return text
    raise AssertionError(f"{page}: no stored table from a cell with {code!r}")


#: A row's median, fastest and slowest milliseconds, as the pages print them.
TIMES = ("ms", "min", "max")


def step_times() -> pd.DataFrame:
    """Chapter 16's timings of the classifier, stored on the page (its
    ``pointnet.time_steps`` table), as rows ``"backend neighbours mode"`` (``"fused csr
    compiled"``) with a forward pass's and a training step's median, fastest and
    slowest milliseconds, in the columns :func:`extkernels.timing.compare` reads."""
    text = stored_output("16_your_model", "pointnet.time_steps(")
    labels = ["backend", "neighbours", "mode"]
    t = pd.read_fwf(
        io.StringIO(text), skiprows=2, header=None, names=[*labels, "pass", *TIMES]
    )
    t[labels] = t[labels].ffill()  # the table prints a repeated label once
    t.index = t[labels].agg(" ".join, axis=1)
    t["metric"] = t["pass"].where(t["pass"] == "forward", "train")
    wide = t.pivot(columns="metric", values=list(TIMES))
    wide.columns = [f"{metric}_{column}" for column, metric in wide.columns]
    return wide


def precisions() -> pd.DataFrame:
    """Chapter 15's autocast table, stored on the page, as rows of dtypes with a
    forward pass's median, fastest and slowest block in milliseconds."""
    text = stored_output("15_shipping", "time_blocks(")
    t = pd.read_fwf(io.StringIO(text), skiprows=1, header=None, index_col=0)
    return t.iloc[:, :3].set_axis([f"forward_{c}" for c in TIMES], axis=1)


#: Tables a page measures and stores itself, by page.
PAGE_TABLES = {"15_shipping": precisions, "16_your_model": step_times}

PAGE_CLAIMS = [
    Claim(
        "15_shipping",
        "Every float32 block is shorter than every bfloat16 and float16 block",
        lambda t: all(below(t, "float32", low, "forward") for low in t.index[1:]),
    ),
    Claim(
        "16_your_model",
        "Compiling shortens the torch CSR step",
        lambda t: below(t, "torch csr compiled", "torch csr eager", "train"),
    ),
    Claim(
        "16_your_model",
        "the fused CSR step's eager and compiled runs overlap",
        lambda t: overlap(t, "fused csr compiled", "fused csr eager", "train"),
    ),
]


def searches() -> pd.DataFrame:
    """Chapter 16's file (:func:`extkernels.experiments.batched.load`) as rows ``"case:
    method"``, a call's median, fastest and slowest milliseconds in the columns that
    :func:`extkernels.timing.compare` reads for ``SEARCH``."""
    _, t = batched.load(BATCHED)
    t.index = [f"{case}: {method}" for case, method in t.index]
    return t.rename(columns={c: f"{SEARCH}_{c}" for c in ("ms", "min", "max")})


def page_text(page: str) -> str:
    """A page's markdown, its whitespace runs made single spaces."""
    nb = nbformat.read(ROOT / "book" / f"{page}.ipynb", as_version=4)
    return " ".join(
        " ".join(c.source.split()) for c in nb.cells if c.cell_type == "markdown"
    )


def _cases() -> list:
    """Every claim with the table its sentence reads and that table's name."""
    sources = [
        (CLAIMS, lambda c: results.load(BENCHMARK)[1], BENCHMARK.name),
        (BATCHED_CLAIMS, lambda c: searches(), BATCHED.name),
        (MACHINE_CLAIMS, lambda c: results.load(MACHINES)[1], MACHINES.name),
        (PAGE_CLAIMS, lambda c: PAGE_TABLES[c.page](), "the page's stored table"),
    ]
    return [
        pytest.param(c, table, name, id=f"{c.page}: {c.words[:40]}")
        for claims, table, name in sources
        for c in claims
    ]


@pytest.mark.parametrize(("claim", "table", "source"), _cases())
def test_a_sentence_reads_what_its_runs_show(claim, table, source):
    assert claim.words in page_text(claim.page), (
        f"{claim.page}: the sentence with {claim.words!r} is gone; rewrite its check"
    )
    assert claim.holds(table(claim)), (
        f"{claim.page}: {claim.words!r} no longer reads what {source} shows"
    )


@pytest.mark.parametrize("page", PAGE_TABLES)
def test_a_pages_stored_table_is_read_whole(page):
    t = PAGE_TABLES[page]()
    expected = {
        "15_shipping": {"float32", "bfloat16", "float16"},
        "16_your_model": {
            f"{b} {n} {m}"
            for b in ("torch", "fused")
            for n in ("csr", "padded")
            for m in ("eager", "compiled")
        },
    }[page]
    assert set(t.index) == expected
    for metric in {c.split("_")[0] for c in t.columns}:
        ms, lo, hi = (t[f"{metric}_{c}"] for c in TIMES)
        assert ((lo <= ms) & (ms <= hi)).all(), f"{page}: {metric} out of order"


def test_the_checks_see_a_sentence_the_runs_contradict():
    t = pd.DataFrame(
        {
            "train_ms": [1.0, 2.0],
            "train_min": [0.9, 1.9],
            "train_max": [1.1, 2.1],
        },
        index=["a", "b"],
    )
    assert below(t, "a", "b", "train") and not overlap(t, "a", "b", "train")
    assert longer(t, "b", "a", "train") and not longer(t, "a", "b", "train")
    assert not within(t, "a", "b", 0.01, "train")
    assert apart_machines(t, "train") == [("a", "b")]
    t.loc["b", "train_min"] = 1.0
    assert overlap(t, "a", "b", "train") and not below(t, "a", "b", "train")
    assert apart_machines(t, "train") == []
