"""extkernels.notebook: versions and fake_tensors."""

import os

import pandas as pd
import pytest
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


def test_the_hosts_gpus_are_counted_from_nvidia_smi(tmp_path, monkeypatch):
    from extkernels import provenance

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200'\necho 'NVIDIA H200'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path), prepend=os.pathsep)
    assert provenance._gpus_on_host() == "2 × NVIDIA H200"
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert provenance._gpus_on_host() == "n/a"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_versions_counts_the_hosts_gpus_beyond_the_visible_ones():
    """The run card says which kind of host ran it: every GPU of the host, not only
    those ``CUDA_VISIBLE_DEVICES`` leaves (the campaign gives each job one)."""
    count, name = notebook.versions().loc["GPUs on the host", "version"].split(" × ")
    assert int(count) >= torch.cuda.device_count()
    assert name == torch.cuda.get_device_name(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_versions_names_the_gpu_it_ran_on_among_the_hosts():
    """Runs of several sessions may come from several GPUs of one kind: the card's
    UUID is the one of the host's GPUs (nvidia-smi's) that this process used."""
    from extkernels import provenance

    uuid = notebook.versions().loc["GPU UUID", "version"]
    host = [u.removeprefix("GPU-") for u in provenance._per_gpu("uuid")]
    assert uuid in host


def test_fake_tensors_run_an_operator_without_data():
    with notebook.fake_tensors():
        x = torch.empty(4, 3)
        y = torch.mm(x, x.T)
    assert y.shape == (4, 4)
    assert type(y).__name__ == "FakeTensor"
