"""Write each inline ``<script>`` once: a back-port of sphinx-doc/sphinx#13402 (merged
2025).

Why sphinx-thebe's ``const THEBE_JS_URL = ...`` appeared twice in every page's <head>:
sphinx-thebe connects ``init_thebe_core`` once, to ``env-before-read-docs``, which fires
once per build, so ``app.add_js_file(None, body=...)`` is called only once. But that
event comes after ``Builder.init()``, and Sphinx 7.4 (which Jupyter Book 1.x uses) then
records the script twice:

1. ``Sphinx.add_js_file`` stores ``(None, attrs)`` in the registry and passes ``None``
   on to ``StandaloneHTMLBuilder.add_js_file``, which keeps ``_JavaScript(None,
   body=...)``;
2. ``StandaloneHTMLBuilder.prepare_writing`` re-adds every registry entry "registered
   after Builder.init()" as ``add_js_file(filename or '', ...)``, i.e. ``_JavaScript('',
   body=...)``.

The builder skips an asset it already has, but ``None != ''``, so both copies are kept,
and a ``const`` declared twice throws a SyntaxError in the browser.
sphinx-togglebutton's ``var togglebuttonSelector`` (added at ``builder-inited``) is
doubled the same way, silently. The upstream fix makes ``Sphinx.add_js_file`` pass
``filename or ''`` to the builder; this extension does the same at the builder, so both
paths produce the same asset and the builder's own duplicate check keeps one. On a
Sphinx that has the fix it changes nothing.
"""

from __future__ import annotations

import functools
from typing import Any

from sphinx.application import Sphinx


def _normalise_inline_js(app: Sphinx) -> None:
    add_js_file = getattr(app.builder, "add_js_file", None)
    if add_js_file is None:  # not an HTML builder
        return

    @functools.wraps(add_js_file)
    def add_js_file_once(filename: str | None, **kwargs: Any) -> None:
        add_js_file(filename or "", **kwargs)

    app.builder.add_js_file = add_js_file_once  # type: ignore[attr-defined]


def setup(app: Sphinx) -> dict[str, Any]:
    # builder-inited comes right after Builder.init(), whose own calls already pass ''.
    # priority=0 (lower runs first) puts this before that event's other handlers, as
    # some of them add inline scripts too (sphinx-togglebutton's selector), as do later
    # events (sphinx-thebe's env-before-read-docs).
    app.connect("builder-inited", _normalise_inline_js, priority=0)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
