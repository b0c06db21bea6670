"""Calling a function in a fresh Python process: what the benchmark (chapter 1), the
allocation experiment (chapter 4), the geometry and traits commands (chapter 14) and
the packaged projectors (chapter 15) do where a process's state would change what they
measure.

:func:`call` runs ``module.name(*args, **kwargs)`` in a new interpreter
(``sys.executable``) and returns its result; arguments and result travel as JSON. A
``module`` that ends in ``.py`` is loaded from that file, so that the child imports
nothing else of this package. Any failure (an exception in the child, a crash, a
timeout) raises :class:`FreshProcessError`, which carries the end of the child's
standard error and its return code; a child that runs past its timeout first writes
where each of its threads stands (:mod:`faulthandler`), so that the error says where it
waited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["FreshProcessError", "call"]

#: The most characters of the child's standard error an error keeps.
TAIL = 4000

_CHILD = """
import faulthandler, importlib, importlib.util, json, sys

module, name, given, out, stacks_after = sys.argv[1:]
if stacks_after:  # every thread's stack, shortly before the parent's timeout kills it
    faulthandler.dump_traceback_later(float(stacks_after))
if module.endswith(".py"):
    spec = importlib.util.spec_from_file_location("fresh_target", module)
    target = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(target)
else:
    target = importlib.import_module(module)
with open(given) as f:
    call = json.load(f)
result = getattr(target, name)(*call["args"], **call["kwargs"])
with open(out, "w") as f:
    json.dump(result, f)
"""


class FreshProcessError(RuntimeError):
    """A call in a fresh process that failed.

    Attributes:
        target: ``module.name`` of the function called.
        returncode: the child's exit status; ``None`` when it ran past its timeout.
        stderr: the end of the child's standard error (at most :data:`TAIL`
            characters).
    """

    def __init__(self, target: str, returncode: int | None, stderr: str):
        self.target, self.returncode, self.stderr = target, returncode, stderr
        how = "timed out" if returncode is None else f"exited with {returncode}"
        super().__init__(f"{target} failed in a fresh process ({how}):\n{stderr}")


def _text(out: str | bytes | None, marker: str | None = None) -> str:
    """At most :data:`TAIL` characters of ``out``: from the line before its last
    ``marker`` (what the child wrote last before it) where there is one, else its
    end."""
    if isinstance(out, bytes):
        out = out.decode(errors="replace")
    out = out or ""
    at = out.rfind(marker) if marker else -1
    if at < 0:
        return out[-TAIL:]
    start = out.rfind("\n", 0, max(at - 1, 0)) + 1
    return out[start : start + TAIL]


def call(
    module: str,
    name: str,
    *args: Any,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> Any:
    """``module.name(*args, **kwargs)`` run in a fresh Python process, its result.

    Args:
        module: a module's import name, or the path of a ``.py`` file to load (the
            child then imports only what that file imports).
        name: the function's name in it.
        args, kwargs: its arguments, JSON-able.
        timeout: seconds the child may run (``None``: no limit).
        env: variables set in the child's environment, on top of this process's.

    Returns:
        What the function returned, through JSON (tuples come back as lists).

    Raises:
        FreshProcessError: the child raised, crashed or ran past ``timeout``; the
            error carries the end of its standard error and its return code.
    """
    target = f"{module}.{name}" if not module.endswith(".py") else f"{module}:{name}"
    child_env = {**os.environ, **(env or {})}
    stacks_after = "" if timeout is None else str(timeout - min(10.0, timeout / 4))
    with tempfile.TemporaryDirectory(prefix="extkernels-fresh-") as tmp:
        given, out = Path(tmp) / "args.json", Path(tmp) / "result.json"
        given.write_text(json.dumps({"args": list(args), "kwargs": kwargs}))
        cmd = [sys.executable, "-c", _CHILD, module, name, str(given), str(out)]
        cmd.append(stacks_after)
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, env=child_env, timeout=timeout
            )
        except subprocess.TimeoutExpired as e:
            # the child's last line before its stacks, then the stacks (innermost first)
            stacks = _text(e.stderr, marker="Timeout (")
            raise FreshProcessError(target, None, stacks) from None
        if done.returncode != 0 or not out.exists():
            raise FreshProcessError(target, done.returncode, _text(done.stderr))
        return json.loads(out.read_text())
