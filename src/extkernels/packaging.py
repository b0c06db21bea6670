"""Projectors exported and compiled ahead of time, and processes that build the C++
libraries instead of loading the prebuilt wheel's (chapter 15).

:func:`package` exports a model and compiles it with AOTInductor into a package
(``.pt2``); :class:`Packaged` is such a package loaded back on its first call, timed
like any projector's forward pass; :func:`just_in_time` makes this process build the
libraries into the extension cache. The benchmark's chapter-15 variants
(:mod:`extkernels.variants`) and chapter 15's experiments
(:mod:`extkernels.experiments.shipping`) use them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from .ops import prebuilt

__all__ = ["Packaged", "just_in_time", "package"]


def package(model: torch.nn.Module, inputs: tuple, path: Path) -> Path:
    """``model`` (in eval mode) exported on ``inputs`` and compiled by AOTInductor into
    the package ``path`` (``.pt2``)."""
    ep = torch.export.export(model.eval(), inputs)
    return Path(torch._inductor.aoti_compile_and_package(ep, package_path=str(path)))


class Packaged:
    """A model exported and compiled by AOTInductor into a package (``.pt2``), loaded
    back on its first call: what a process that ships it pays first (chapter 15)."""

    def __init__(self, model: torch.nn.Module, p_query, p_ref):
        with torch.no_grad():
            model.eval()(p_query, p_ref)  # loads the backend's library before the trace
        folder = Path(tempfile.mkdtemp(prefix="extkernels-"))
        self.path = package(model, (p_query, p_ref), folder / "projector.pt2")
        self.runner = None

    def __call__(self, p_query, p_ref):
        if self.runner is None:
            self.runner = torch._inductor.aoti_load_package(str(self.path))
        return self.runner(p_query, p_ref)


def just_in_time(cold: bool) -> None:
    """Leave the prebuilt wheel unused in this process and, for a ``cold`` run, empty
    the extension cache it builds into (the warm runs load the cold run's build)."""
    os.environ[prebuilt.ENV] = "0"
    cache = Path(tempfile.gettempdir()) / "extkernels-jit"
    if cold:
        shutil.rmtree(cache, ignore_errors=True)
    os.environ["TORCH_EXTENSIONS_DIR"] = str(cache)
