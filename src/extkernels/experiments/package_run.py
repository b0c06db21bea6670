"""What a fresh process of :func:`extkernels.experiments.shipping.run_fresh` runs
(chapter 15): load operator libraries, import modules, then load an AOTInductor
package, run it and time it. :func:`extkernels.fresh.call` loads this file by its
path, so that the process imports PyTorch and nothing of this package but the modules
it is told to.
"""

from __future__ import annotations

import importlib

import torch


def run(
    package: str,
    data: str,
    *,
    libraries: list[str] = (),
    imports: list[str] = (),
    seconds: float | None = None,
) -> dict:
    """Load ``libraries`` and import ``imports``, then load ``package`` and call it on
    the inputs saved in ``data`` (with the expected output), timing it for about
    ``seconds`` (``None``: not at all). A failure to load or call the package is a
    result (``error``), not an exception."""
    for library in libraries:
        torch.ops.load_library(library)
    for module in imports:
        importlib.import_module(module)
    saved = torch.load(data)
    try:
        runner = torch._inductor.aoti_load_package(package)
        out = runner(*saved["inputs"])
    except Exception as e:  # noqa: BLE001  (what a reader's process would see)
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    diff = (out - saved["expected"]).abs().max().item()
    ms = None
    if seconds is not None:
        from torch.utils import benchmark

        timer = benchmark.Timer(
            "runner(*inputs)", globals={"runner": runner, "inputs": saved["inputs"]}
        )
        ms = timer.blocked_autorange(min_run_time=seconds).median * 1e3
    return {"error": None, "max_abs_diff": diff, "ms": ms}
