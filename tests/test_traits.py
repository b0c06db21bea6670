"""The probes of chapter 14's library table (``extkernels.experiments.traits``): a call
that copies a result to the host waits for the GPU and cannot be captured; one that
only queues kernels does neither."""

import subprocess
import sys

import pytest
import torch

from extkernels import clouds
from extkernels.experiments import traits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _workload():
    return clouds.workload("normal", 2000, side=6, device="cuda")


def _on_the_gpu(w):
    def search():
        return torch.cdist(w.p_query, w.p_ref).topk(7, largest=False)

    return search


def _through_the_host(w):
    def search():
        d, i = torch.cdist(w.p_query, w.p_ref).topk(7, largest=False)
        return d.cpu().cuda(), i

    return search


def test_a_search_that_only_queues_kernels_neither_waits_nor_fails_to_capture():
    w = _workload()
    assert not traits.waits(_on_the_gpu(w))
    assert traits.captures(_on_the_gpu(w), w)


def test_a_search_through_the_host_waits_and_does_not_capture():
    w = _workload()
    assert traits.waits(_through_the_host(w))
    # the failed capture in a child process, as the command probes every method
    code = (
        "import sys; sys.path.insert(0, 'tests'); import test_traits as t; "
        "from extkernels.experiments import traits; w = t._workload(); "
        "print(traits.captures(t._through_the_host(w), w))"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.stdout.strip().splitlines()[-1] == "False", child.stderr
