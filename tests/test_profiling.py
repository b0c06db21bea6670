"""extkernels.profiling: top_kernels, stacked, graphs_and_breaks, break_reasons."""

import os
import subprocess
import sys

import pytest
import torch

import extkernels
from extkernels import profiling

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def knn_kernels():
    p_ref = extkernels.reference_cloud(500)
    p_query = extkernels.query_grid(6)
    prof = profiling.profile(
        lambda: extkernels.knn(p_query, p_ref, 7), device=CPU, n_iters=2
    )
    return profiling.top_kernels(prof)


def test_top_kernels_columns(knn_kernels):
    assert list(knn_kernels.columns) == [
        "name",
        "time (ms)",
        "share (%)",
        "calls",
        "memory (MiB)",
    ]


def test_top_kernels_is_not_empty_and_capped(knn_kernels):
    assert 0 < len(knn_kernels) <= 8


def test_top_kernels_shares_sum_to_at_most_100(knn_kernels):
    assert knn_kernels["share (%)"].sum() <= 100 + 0.01
    assert (knn_kernels["share (%)"] > 0).all()


def test_top_kernels_sorted_by_time_descending(knn_kernels):
    times = knn_kernels["time (ms)"].tolist()
    assert times == sorted(times, reverse=True)


def test_top_kernels_show_topk(knn_kernels):
    assert knn_kernels["name"].str.contains("topk").any()


def test_top_kernels_counts_calls_per_iteration():
    p_ref = extkernels.reference_cloud(50)
    p_query = extkernels.query_grid(3)
    prof = profiling.profile(
        lambda: extkernels.knn(p_query, p_ref, 3), device=CPU, n_iters=3
    )
    df = profiling.top_kernels(prof, top=50)
    assert df.loc[df["name"] == "aten::topk", "calls"].tolist() == [1]


def test_stacked_keeps_the_columns_and_puts_each_table_under_its_title(knn_kernels):
    table = profiling.stacked({"eager": knn_kernels, "other": knn_kernels.head(2)})
    assert list(table.columns) == list(knn_kernels.columns)
    assert list(table.index.get_level_values(0).unique()) == ["eager", "other"]
    assert len(table.loc["other"]) == 2 and len(table) == len(knn_kernels) + 2


@pytest.mark.gpu
def test_top_kernels_on_the_host_show_the_compiled_wrapper():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = torch.randn(1024, device="cuda")
    fn = torch.compile(lambda t: (t * 2).sin())
    prof = profiling.profile(lambda: fn(x), device=torch.device("cuda"), n_iters=3)
    host = profiling.top_kernels(prof, top=50, host=True)["name"]
    device = profiling.top_kernels(prof, top=50)["name"]
    # The generated kernel runs on the device; the wrapper of the region on the host.
    assert host.str.contains("Compiled|compiled", regex=True).any(), host.tolist()
    assert not device.str.contains("Torch-Compiled Region").any(), device.tolist()


def _broken(x):
    x = x + 1
    torch._dynamo.graph_break()
    return x * 2


def test_graphs_and_breaks_counts_a_break():
    torch._dynamo.reset()
    assert profiling.graphs_and_breaks(lambda x: x.sin() + 1, torch.ones(3)) == (1, 0)
    assert profiling.graphs_and_breaks(_broken, torch.ones(3)) == (2, 1)


def test_break_reasons_names_an_explicit_break_and_none_without_one():
    torch._dynamo.reset()
    assert profiling.break_reasons(lambda x: x.sin(), torch.ones(3)) == []
    whole = profiling.break_reasons(_broken, torch.ones(3), lines=2, width=10_000)
    assert len(whole) == 1 and len(whole[0].splitlines()) <= 2
    reasons = profiling.break_reasons(_broken, torch.ones(3), lines=2, width=30)
    assert len(reasons) == 1
    # wrapped, not cut: every word of the first two lines is still there
    assert reasons[0].split() == whole[0].split()
    assert len(reasons[0].splitlines()) > len(whole[0].splitlines())


def test_a_profile_prints_nothing_of_its_own():
    """Kineto's USDT lines around a profile would show in every page that profiles."""
    code = (
        "import torch\n"
        "from extkernels import profiling\n"
        "x = torch.randn(64, 64)\n"
        "profiling.profile(lambda: x @ x, device=torch.device('cpu'), n_iters=1)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr
    assert "USDT" not in run.stdout + run.stderr, run.stdout + run.stderr
