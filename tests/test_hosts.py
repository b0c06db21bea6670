"""Comparisons from one host: a page compares timings only from runs of the host it ran
on, and every data file holds one host's runs (the run cards' ``host CPU``; the host
sets the pace of every step the CPU launches, so two hosts' runs are not compared)."""

import ast
import json
import re
from pathlib import Path

import nbformat
import pytest
from conftest import ROOT

DATA = ROOT / "book" / "data"
PAGES = sorted((ROOT / "book").glob("*.ipynb"))
FILES = sorted(DATA.glob("*.json"))

HOST = re.compile(r"host CPU\s+(.+)")
DATA_FILE = re.compile(r"data/([\w.-]+\.json)")


def hosts_of_file(path: Path) -> set[str]:
    """The hosts a data file's run card names."""
    versions = json.loads(path.read_text())["meta"].get("versions", {})
    return set(versions.get("host CPU", "unknown").split("; "))


def host_of_page(path: Path) -> set[str]:
    """The hosts a page's first run card (its ``versions()`` cell) names."""
    for cell in nbformat.read(path, as_version=4).cells:
        for out in cell.get("outputs", []):
            text = out.get("text") or out.get("data", {}).get("text/plain", "")
            found = HOST.search(text)
            if found:
                return set(found.group(1).strip().split("; "))
    return set()


def files_of_page(path: Path) -> set[str]:
    """The data files a page's code reads: by name, or through ``results.recorded``
    (the benchmark file) and ``results.SHIPPING``."""
    from extkernels import results

    files = set()
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        files |= set(DATA_FILE.findall(cell.source))
        if "recorded(" in cell.source and reads_default_file(cell.source):
            files.add(Path(results.BENCHMARK).name)
        if "SHIPPING" in cell.source:
            files.add(Path(results.SHIPPING).name)
    return files


def reads_default_file(source: str) -> bool:
    """Whether ``source`` calls ``recorded`` without naming a file (its ``path``
    defaults to the benchmark file)."""
    return any(
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "recorded"
        and len(node.args) < 2
        and not node.keywords
        for node in ast.walk(ast.parse(source))
    )


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_a_data_file_holds_one_hosts_runs(path):
    hosts = hosts_of_file(path)
    assert len(hosts) == 1, f"{path.name}: runs of several hosts: {sorted(hosts)}"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.stem)
def test_a_page_compares_runs_of_its_own_host(path):
    hosts = host_of_page(path)
    assert hosts, f"{path.name}: no run card names the host it ran on"
    for name in files_of_page(path):
        assert (DATA / name).exists(), f"{path.name} reads {name}, which is not there"
        hosts |= hosts_of_file(DATA / name)
    assert len(hosts) == 1, f"{path.name}: runs of several hosts: {sorted(hosts)}"


def test_a_call_names_its_file_or_reads_the_benchmark():
    assert not reads_default_file('results.recorded(["a", f(b)], results.SHIPPING)')
    assert not reads_default_file("recorded(names, path=results.SHIPPING)")
    assert reads_default_file('x = 1\nresults.recorded(["a", f(b)])')
    assert reads_default_file("recorded(x)")


def test_the_rule_sees_two_hosts(tmp_path):
    card = {"meta": {"versions": {"host CPU": "A (16 cores); B (32 cores)"}}}
    (tmp_path / "x.json").write_text(json.dumps(card))
    assert hosts_of_file(tmp_path / "x.json") == {"A (16 cores)", "B (32 cores)"}
