"""Registrations that wait for a compiled library (chapters 9 and 11).

The operators of a C++ library exist only once it is loaded, and loading may mean a
build of a minute or more: importing a module must never do that. Its Python half
(fakes, autograd formulas, the value-check switch) is therefore written where the
module defines it but registered later, through an :class:`OnLoad`: the library's
``load()`` calls :meth:`OnLoad.run` right after loading it, and a registration declared
after that is made at once. Either way each is made exactly once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["OnLoad"]


class OnLoad:
    """Registrations on the operators of one compiled library, made once it loads."""

    def __init__(self) -> None:
        self._pending: list[Callable[[], object]] = []
        self.loaded = False

    def __call__(self, step: Callable[[], object]) -> Callable[[], object]:
        """Run ``step()`` once the library is loaded (now, if it is); returns it, so
        that it decorates a function."""
        if self.loaded:
            step()
        else:
            self._pending.append(step)
        return step

    def register_fake(self, qualname: str) -> Callable:
        """A decorator: ``torch.library.register_fake(qualname)`` on the function once
        the library is loaded; the function is returned unchanged."""

        def decorate(fake: Callable) -> Callable:
            self(lambda: torch.library.register_fake(qualname, fake))
            return fake

        return decorate

    def register_autograd(
        self, qualname: str, backward: Callable, *, setup_context: Callable
    ) -> None:
        """``torch.library.register_autograd`` once the library is loaded."""
        self(
            lambda: torch.library.register_autograd(
                qualname, backward, setup_context=setup_context
            )
        )

    def run(self) -> None:
        """Make the pending registrations (the library has just been loaded); later
        calls do nothing."""
        self.loaded = True
        while self._pending:
            self._pending.pop(0)()
