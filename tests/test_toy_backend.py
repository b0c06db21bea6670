"""A backend from one file: a toy brute-force kNN defined and registered here, and
nowhere else, put through the whole conformance suite (``tests/test_backends.py``),
unchanged.

The suite parametrizes its tests over ``registry.registered()`` when it is imported.
This file imports it afresh while the toy is the only registered backend
(``registry.scratch(TOY, alone=True)``), so that every test of the suite that takes a
backend comes here, parametrized for the toy alone; the toy is registered around each
test of this file only, so that no other test file sees it. The toy's search is a
custom operator with a fake, so the operator's part of the suite (``opcheck``, the
operator's and the fake's refusals) runs on it too; its ``knn_aggregate`` is the one the
registry derives from the search (chapter 3 teaches both).

The toy's book record (``registry.Book``) declares its variants of the benchmark, what
their names mean, its row of the guide and its search method of chapter 14, and nothing
else is edited: the benchmark's ``--list``, the campaign's plan, the geometry command's
methods, the guide and its glossary show it, as README's "Adding a backend" says.
"""

import importlib.util
import inspect
from pathlib import Path

import pytest
import test_registry as registry_tests
import torch

from extkernels import benchmark, campaign, guide, results
from extkernels.experiments import geometry
from extkernels.ops import registry
from extkernels.ops.checks import check_knn

NAME = "toy"


@torch.library.custom_op("extkernels_toy::knn", mutates_args=())
def knn_op(
    p_query: torch.Tensor, p_ref: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every distance, in float64 from differences of coordinates (exact enough far
    from the origin too), then the ``k`` smallest of each row."""
    k = check_knn(p_query, p_ref, k)
    distances = (p_query.double()[:, None] - p_ref.double()[None]).norm(dim=-1)
    found = distances.topk(k, dim=1, largest=False)
    return found.values.float(), found.indices


@knn_op.register_fake
def _(p_query, p_ref, k):
    k = check_knn(p_query, p_ref, k, values=False)
    rows = p_query.shape[0]
    return p_query.new_empty(rows, k), p_query.new_empty(rows, k, dtype=torch.int64)


def knn(p_query, p_ref, k):
    return torch.ops.extkernels_toy.knn(p_query, p_ref, k)


TOY = registry.Backend(
    NAME,
    devices=("cpu",),
    knn=knn,
    operators={"knn": "extkernels_toy::knn"},
    book=registry.Book(
        chapter=3,
        toolchain="PyTorch only",
        variants=lambda v: [
            v.Variant("knn/toy", "knn", NAME, chapter=3),
            v.compiled("knn/toy+compile", NAME, 3),
        ],
        glossary={"toy": "a brute force declared in one test file (chapter 3)"},
        advice=lambda g: [
            g.Advice(
                "kNN from one test file",
                "the toy brute force, a custom operator {registered}",
                "knn/toy+compile",
                "knn",
            )
        ],
        methods={"toy": {}},
    ),
)

DATA = Path(__file__).resolve().parents[1] / "book" / "data"


def _suite_for(backend: registry.Backend):
    """``tests/test_backends.py``, imported afresh while ``backend`` is the only
    registered backend."""
    path = Path(__file__).with_name("test_backends.py")
    spec = importlib.util.spec_from_file_location("conformance_of_the_toy", path)
    module = importlib.util.module_from_spec(spec)
    with registry.scratch(backend, alone=True):
        spec.loader.exec_module(module)
    return module


def _parametrized(test) -> set[str]:
    marks = getattr(test, "pytestmark", [])
    names = [m.args[0] for m in marks if m.name == "parametrize"]
    return {n.strip() for argnames in names for n in argnames.split(",")}


def _of_the_toy(test) -> bool:
    """A test of a backend that has cases for the toy (none where the toy implements
    nothing it asks for, such as a radius aggregation)."""
    marks = [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize"]
    of_a_backend = [m for m in marks if "backend" in m.args[0]]
    return bool(of_a_backend) and all(len(m.args[1]) for m in of_a_backend)


SUITE = _suite_for(TOY)
#: The suite's tests of a backend that the toy has cases of, with the fixtures of the
#: suite they ask for, made this module's (pytest collects them here).
COPIED = []
for _name, _test in vars(SUITE).items():
    if _name.startswith("test_") and _of_the_toy(_test):
        COPIED.append(_name)
        globals()[_name] = _test
        for _arg in set(inspect.signature(_test).parameters) - _parametrized(_test):
            if hasattr(SUITE, _arg):
                globals()[_arg] = getattr(SUITE, _arg)
#: The backends registered outside this file's tests.
OUTSIDE = [b.name for b in registry.registered()]


@pytest.fixture(autouse=True)
def toy_registered():
    """The toy registered for one test; gone after it."""
    with registry.scratch(TOY):
        yield


def test_the_suite_came_here_for_the_toy_alone():
    assert {
        "test_knn_is_exact",
        "test_aggregation_and_its_gradient_are_exact",
        "test_deterministic_mode_repeats_every_bit_or_refuses",
        "test_knn_entry_point_rejects",
        "test_custom_operator_rejects",
        "test_fake_implementation_rejects",
        "test_opcheck",
        "test_compiles_with_fullgraph_and_matches_eager",
    } <= set(COPIED)
    for name in COPIED:
        for mark in globals()[name].pytestmark:
            if mark.name != "parametrize" or "backend" not in mark.args[0]:
                continue
            where = [n.strip() for n in mark.args[0].split(",")].index("backend")
            assert {p.values[where] for p in mark.args[1]} <= {NAME}, name


def test_no_other_test_file_sees_the_toy():
    assert NAME not in OUTSIDE
    assert NAME in [b.name for b in registry.registered()]  # inside this file's tests


def test_the_toy_carries_what_the_guide_and_the_benchmark_need():
    registry_tests.test_every_backend_states_its_toolchain()
    registry_tests.test_every_backend_is_benchmarked_or_says_why_not()


def test_the_benchmark_lists_the_toys_variants(capsys):
    assert benchmark.main(["--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert {"knn/toy", "knn/toy+compile"} <= set(listed)
    # after the search backends of chapter 3 and before those of later chapters
    assert listed.index("knn/cuml-op+compile+rmm-rapids") < listed.index("knn/toy")
    assert listed.index("knn/toy+compile") < listed.index("knn/triton")


def test_the_campaign_plans_the_toys_runs():
    jobs = [j.name for j in campaign.plan(repeats=1)]
    assert {"bench:knn/toy", "bench:knn/toy+compile", "geometry:toy"} <= set(jobs)
    assert geometry.METHODS["toy"] == (NAME, {})


def test_no_list_names_the_toy_once_it_is_gone():
    from extkernels import variants

    with registry.scratch():
        registry._BACKENDS.pop(NAME)
        assert not [v for v in variants.VARIANTS if v.backend == NAME]
        assert "toy" not in geometry.METHODS
        assert "toy" not in guide.GLOSSARY
        assert NAME not in [backend for backend, _ in guide.advice()]


def test_the_guide_shows_the_toys_row_and_the_glossary_its_name():
    _, bench = results.load(DATA / "benchmark-h200.json")
    _, clouds = results.load(DATA / "benchmark-clouds-h200.json")
    _, times, _ = geometry.load(DATA / "geometry-h200.json")
    table = guide.guide(bench, clouds, times)
    row = table.loc["kNN from one test file"]
    # its operator has a fake and no autograd formula: the registry's derived
    # aggregation differentiates through the gather
    assert row["use"] == (
        "the toy brute force, a custom operator with a fake and no gradient formula, "
        "which the neighbours do not need"
    )
    assert row["on the book's cloud"] == row["on real geometry"] == "not measured"
    assert row["cost"].endswith("lines; PyTorch only")
    # after the kNN rows of the backends the book's order of advice names
    situations = list(table.index)
    where = situations.index("kNN from one test file")
    assert situations[where - 1] == "A kNN library you already use (cuML)"
    assert situations[where + 1] == "Radius neighbourhoods"
    # its words in the glossary, among the backends of chapter 3
    parts = list(guide.GLOSSARY)
    assert parts.index("cuml-op") < parts.index("toy") < parts.index("warp")
