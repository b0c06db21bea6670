"""extkernels.notebook: versions and fake_tensors."""

import os

import pandas as pd
import torch

from extkernels import notebook


def test_versions_is_indexed_by_component():
    df = notebook.versions()
    assert isinstance(df, pd.DataFrame)
    assert df.index.name == "component"
    assert {"torch", "device", "python"} <= set(df.index)


def test_versions_reports_the_running_torch():
    assert notebook.versions().loc["torch", "version"] == torch.__version__


def test_versions_names_the_host_cpu_and_its_cores():
    host = notebook.versions().loc["host CPU", "version"]
    assert host.endswith(f"({os.cpu_count()} cores)")
    assert len(host) > len(f" ({os.cpu_count()} cores)")


def test_versions_names_the_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert notebook.versions().loc["device", "version"].startswith("CPU")


def test_fake_tensors_run_an_operator_without_data():
    with notebook.fake_tensors():
        x = torch.empty(4, 3)
        y = torch.mm(x, x.T)
    assert y.shape == (4, 4)
    assert type(y).__name__ == "FakeTensor"
