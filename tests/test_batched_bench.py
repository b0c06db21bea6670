"""Chapter 16's timing command: every method it times computes the same neighbours,
and its table takes medians and spreads over the runs."""

import pytest
import torch

from extkernels.experiments import batched
from extkernels.fresh import FreshProcessError
from extkernels.problem import problem


def _distances(result) -> torch.Tensor:
    """The sorted neighbour distances of one method's result, as one (M, k) tensor."""
    if isinstance(result, list):  # a loop of clouds
        return torch.cat([d for d, _ in result])
    d = result[0] if isinstance(result, tuple) else result.values
    return d.reshape(-1, d.shape[-1])


@pytest.mark.parametrize("case", ["batch", "single"])
def test_every_knn_method_finds_the_same_neighbours(case):
    device = problem().device
    found = {
        name: _distances(build()())
        for name, build in batched.methods(case, device).items()
    }
    reference = found.pop("torch") if case == "single" else found.pop("torch, offsets")
    assert len(found) >= 2
    for name, d in found.items():
        # cdist's default expands |q - p|^2 as |q|^2 + |p|^2 - 2 q.p: a distance of 0
        # comes back as up to ~1e-3 (sqrt of float32 rounding)
        atol = 2e-3 if "cdist" in name else 1e-5
        torch.testing.assert_close(d, reference, rtol=1e-5, atol=atol, msg=name)


def test_the_crossover_compares_like_with_like():
    device = problem().device
    found = {
        name: _distances(build()())
        for name, build in batched.methods("crossover", device).items()
    }
    sizes = {name.split(",")[0] for name in found}
    assert len(sizes) >= 2
    for size in sizes:
        torch.testing.assert_close(
            found[f"{size}, fused, knn_batched"],
            found[f"{size}, fused, loop of clouds"],
            rtol=1e-5,
            atol=1e-5,
        )


def test_radius_methods_are_the_search_and_the_aggregations():
    device = problem().device
    names = set(batched.methods("radius", device))
    for backend in ("torch", "fused"):
        assert f"radius_search {backend}, CSR" in names
        assert f"radius_search {backend}, 64 nearest" in names
        assert f"radius_aggregate {backend}, forward" in names


def test_an_unknown_case_is_named():
    with pytest.raises(
        ValueError, match="case: expected one of batch, single, crossover, radius"
    ):
        batched.methods("batches", problem().device)


def test_the_table_takes_medians_over_runs_and_leaves_out_failures():
    rows = [
        {"case": "batch", "method": "a", "ms": ms, "run": r}
        for r, ms in enumerate([3.0, 1.0, 2.0])
    ]
    rows.append({"case": "batch", "method": "b", "error": "RuntimeError: no", "run": 0})
    table = batched.table(rows)
    assert list(table.index) == [("batch", "a")]
    assert table.loc[("batch", "a")].tolist() == [2.0, 1.0, 3.0, 3]


#: A stand-in for the module's time_case, loaded alone in the fresh processes: methods
#: a, b and c, of which HANG sleeps (None: before it names any method).
FAKE = """
import time
from pathlib import Path

def time_case(case, skip=(), started=None):
    if HANG is None:
        time.sleep(60)
    rows = []
    for name in [m for m in ("a", "b", "c") if m not in skip]:
        Path(started).write_text(name)
        if name == HANG:
            time.sleep(60)
        rows.append({"case": case, "method": name, "ms": 1.0})
    return rows
"""


def _fake(tmp_path, hang) -> str:
    path = tmp_path / "fake_batched.py"
    path.write_text(f"HANG = {hang!r}\n{FAKE}")
    return str(path)


def test_a_method_that_hangs_is_left_out_and_the_others_are_timed(tmp_path):
    """A method past the timeout is recorded as not timed in every run, and waited
    for once: the case's other methods run again in a fresh process."""
    rows = batched.bench(("x",), repeats=2, timeout=3.0, module=_fake(tmp_path, "b"))
    timed = {(r["run"], r["method"]) for r in rows if "ms" in r}
    assert timed == {(run, m) for run in (0, 1) for m in ("a", "c")}
    failed = [r for r in rows if "error" in r]
    assert [(r["run"], r["method"]) for r in failed] == [(0, "b"), (1, "b")]
    assert failed[0]["error"] == "ran past 3 s in a fresh process"


def test_a_run_that_hangs_before_a_method_raises_and_says_where(tmp_path):
    """A fresh process past its timeout that named no method raises, with its stacks,
    in place of hanging the campaign's job."""
    with pytest.raises(FreshProcessError, match="timed out") as e:
        batched.bench(("x",), repeats=1, timeout=3.0, module=_fake(tmp_path, None))
    assert "Timeout (" in e.value.stderr  # every thread's stack, before the kill


def test_the_command_times_each_method_in_a_fresh_process(tmp_path):
    out = tmp_path / "batched.json"
    argv = ["bench", "--cases", "single", "--repeats", "1", "--out", str(out)]
    assert batched.main(argv) == 0
    meta, table = batched.load(out)
    assert {m for _, m in table.index} == set(
        batched.methods("single", problem().device)
    )
    assert (table["runs"] == 1).all() and (table["ms"] > 0).all()
    assert meta["repeats"] == 1


def test_a_case_names_each_method_before_it_times_it(capsys):
    """What a run that hangs wrote last names the method it hung in."""
    rows = batched.time_case("single", n_blocks=1, budget_ms=1)
    started = capsys.readouterr().err.splitlines()
    assert started == [f"single: {row['method']}" for row in rows]
