"""Chapter 4's allocation experiment: its fresh-process runs and the numbers its prose
quotes (the measurements themselves need a CUDA GPU with RAPIDS)."""

import pandas as pd
import pytest
import torch

from extkernels.experiments import allocations

NONE, RAPIDS, SHARED = (
    "knn/cuml-op+compile",
    "knn/cuml-op+compile+rmm-rapids",
    "knn/cuml-op+compile+rmm",
)


def _table() -> pd.DataFrame:
    rows = {
        NONE: (12.0, 11.5, 12.5, 14.0, 13.5, 14.5),
        RAPIDS: (9.0, 8.9, 9.1, 11.0, 10.9, 11.1),
        SHARED: (10.0, 9.9, 10.1, 11.2, 10.5, 13.6),
    }
    cols = ["forward_ms", "forward_min", "forward_max"]
    cols += ["train_ms", "train_min", "train_max"]
    return pd.DataFrame.from_dict(rows, orient="index", columns=cols)


def test_timing_numbers_compare_each_pool_with_none():
    numbers = allocations.timing_numbers(_table(), NONE, RAPIDS, SHARED)
    assert numbers == {
        "rmm_fwd_ms": 10.0,
        "rmm_fwd_gain": 1.2,
        "rmm_train_gain": pytest.approx(14.0 / 11.2),
        "rapids_fwd_gain": pytest.approx(12.0 / 9.0),
        "saved_step_ms": pytest.approx(2.8),
    }
    assert all(type(v) is float for v in numbers.values())


def _calls() -> pd.DataFrame:
    per_pool = {
        "none": {"cudaFree": (33.0, 7.3), "cudaStreamSynchronize": (5.0, 0.026)},
        "shared": {"cudaFree": (0.0, 0.0), "cudaStreamSynchronize": (5.0, 0.031)},
    }
    return pd.concat(
        {
            pool: pd.DataFrame.from_dict(
                rows, orient="index", columns=["calls", "host time (ms)"]
            ).rename_axis("name")
            for pool, rows in per_pool.items()
        }
    )


def test_call_numbers_read_the_pool_without_and_with_sharing():
    assert allocations.call_numbers(_calls()) == {
        "free_calls": 33.0,
        "free_ms": 7.3,
        "sync_none_ms": 0.026,
        "sync_shared_ms": 0.031,
    }


def test_calls_in_fresh_process_runs_the_module_and_reads_its_table(monkeypatch):
    seen = {}

    def call(module, name, *args, **kwargs):
        seen.update(module=module, name=name, args=args)
        return [{"name": "cudaFree", "calls": 33.0, "host time (ms)": 7.3}]

    monkeypatch.setattr(allocations.fresh, "call", call)
    calls = allocations.calls_in_fresh_process("rapids")
    assert (seen["module"], seen["name"]) == (allocations.__name__, "allocation_rows")
    assert seen["args"] == ("rapids", "cuml")
    assert calls.loc["cudaFree", "calls"] == 33.0


def test_calls_in_fresh_process_refuses_an_unknown_pool(monkeypatch):
    monkeypatch.setattr(allocations.fresh, "call", pytest.fail)
    with pytest.raises(ValueError, match="^pool: expected one of"):
        allocations.calls_in_fresh_process("cupy")


def test_the_projector_is_the_benchmarks_variant(monkeypatch):
    from extkernels import problem, variants

    monkeypatch.setenv("EXTKERNELS_SMALL", "1")
    prob = problem()
    model, data = allocations.projector("torch", prob)
    want, _, want_data = variants.get("knn/torch").build(prob)
    for got, expected in zip(data, want_data, strict=True):
        assert torch.equal(got, expected)
    for (name, got), expected in zip(
        model.state_dict().items(), want.state_dict().values(), strict=True
    ):
        assert torch.equal(got, expected), name
