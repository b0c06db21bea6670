"""Every page of the built website, opened in headless Chromium as a reader's browser
would.

Offline: every request that is not file:// is aborted (and not counted), but any file://
resource that fails to load is. Each page is loaded once, at 1280 x 900, for all the
checks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from conftest import toc_files

try:
    from playwright.sync_api import (
        Browser,
        ConsoleMessage,
        Page,
        Request,
        Route,
        sync_playwright,
    )
except ImportError:  # reported by the `browser` fixture
    sync_playwright = None

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium")
VIEWPORT = {"width": 1280, "height": 900}
COLUMN = "article.bd-article"  # the sphinx-book-theme's content column
WIDE = "table, pre, div.highlight, div.cell_output, div.output"
# myst-nb renders a missing glue key as nothing at all (only the build warns), so the
# glue check also counts the {glue:text} roles of the page's source against the values
# pasted in the page.
GLUE_MARKERS = ("{glue:", "glue:text")
GLUE_ROLE = re.compile(r"\{glue:text\}`[^`]+`")


@dataclass
class Opened:
    """A loaded page and what went wrong while loading it."""

    path: str
    page: Page
    errors: list[str] = field(default_factory=list)


def _offline(route: Route) -> None:
    """Let file:// requests through and abort every other one."""
    if route.request.url.startswith("file:"):
        route.continue_()
    else:
        route.abort()


def _watch(page: Page, errors: list[str]) -> None:
    """Record the page's console errors, uncaught exceptions and failed file:// loads.

    A blocked non-file request fails with net::ERR_FAILED and logs a console error: not
    recorded.
    """

    def console(msg: ConsoleMessage) -> None:
        url = msg.location.get("url", "")
        if msg.type == "error" and not (
            "net::ERR_FAILED" in msg.text and url.startswith("http")
        ):
            errors.append(
                f"console error: {msg.text} (at {url}:{msg.location.get('lineNumber')})"
            )

    def failed(request: Request) -> None:
        if request.url.startswith("file:"):
            errors.append(f"failed to load {request.url}: {request.failure}")

    page.on("console", console)
    page.on("requestfailed", failed)
    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))


@cache
def _anchors(html_file: Path) -> frozenset[str]:
    """Every id (and <a name>) in an HTML file: the fragments a link may point to."""
    found: set[str] = set()

    class Collect(HTMLParser):
        def handle_starttag(
            self, tag: str, attrs: list[tuple[str, str | None]]
        ) -> None:
            a = dict(attrs)
            found.update(
                v
                for k, v in a.items()
                if v and (k == "id" or (tag, k) == ("a", "name"))
            )

    Collect().feed(html_file.read_text(encoding="utf-8"))
    return frozenset(found)


def _glue_roles(source: Path) -> int:
    """How many {glue:text} roles the markdown of a page's source holds."""
    text = source.read_text(encoding="utf-8")
    if source.suffix == ".ipynb":
        cells = json.loads(text)["cells"]
        text = "\n".join(
            "".join(c["source"]) for c in cells if c["cell_type"] == "markdown"
        )
    return len(GLUE_ROLE.findall(text))


def _fail_if(problems: list[str], what: str) -> None:
    """Fail, one line per problem, under a heading that names the page, if there are
    any."""
    if problems:
        pytest.fail(f"{what}:\n  " + "\n  ".join(problems), pytrace=False)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Debian's chromium, driven by playwright; under CI its absence is a failure."""
    missing = None
    if sync_playwright is None:
        missing = (
            "the Python package playwright is not installed (pip install playwright)"
        )
    elif CHROMIUM is None:
        missing = "Debian's chromium is not installed (apt-get install -y chromium)"
    if missing:
        if os.environ.get("CI"):
            pytest.fail(
                f"{missing}: CI must check the website in a browser", pytrace=False
            )
        pytest.skip(missing)
    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox"], headless=True
        )
        yield chromium
        chromium.close()


@pytest.fixture(scope="module", params=[f"{f}.html" for f in toc_files()], ids=str)
def opened(request, browser: Browser, built_site: Path) -> Iterator[Opened]:
    """One page of the site, loaded offline with its fonts, its console watched."""
    page = browser.new_page(viewport=VIEWPORT)
    # a page's load waits on the machine: CI's two cores may be busy with other tests
    page.set_default_timeout(120_000)
    result = Opened(request.param, page)
    page.route("**/*", _offline)
    _watch(page, result.errors)
    page.goto((built_site / request.param).as_uri(), wait_until="load")
    page.wait_for_load_state("networkidle")
    page.evaluate("document.fonts.ready.then(() => null)")
    yield result
    page.close()


def test_no_console_or_page_errors(opened: Opened):
    _fail_if(opened.errors, f"{opened.path}: errors while loading")


def test_math_renders_offline(opened: Opened):
    """Math is typeset by the site's own copy of MathJax, with the network cut."""
    written = opened.page.locator("span.math, div.math").count()
    if written == 0:
        pytest.skip("no math on this page")
    opened.page.wait_for_function(
        "n => document.querySelectorAll('mjx-container').length >= n",
        arg=written,
        timeout=15_000,
    )
    assert "\\(" not in opened.page.inner_text(COLUMN)


def test_every_image_loads(opened: Opened):
    broken = opened.page.evaluate(
        """() => Array.from(document.images)
            .filter(img => !(img.complete && img.naturalWidth > 0))
            .map(img => img.getAttribute('src'))"""
    )
    _fail_if(broken, f"{opened.path}: images that did not load")


def test_nothing_overflows_the_content_column(opened: Opened):
    wide = opened.page.evaluate(
        r"""([column, selectors]) => {
            const col = document.querySelector(column);
            const edge = Math.round(col.getBoundingClientRect().right
                - parseFloat(getComputedStyle(col).paddingRight));
            return Array.from(col.querySelectorAll(selectors)).flatMap(el => {
                const box = el.getBoundingClientRect(), right = Math.round(box.right);
                const why = [`width ${Math.round(box.width)}px`];
                if (right > edge + 1)
                    why.push(`right edge ${right}px > column's ${edge}px`);
                if (el.scrollWidth > el.clientWidth + 1)
                    why.push(`scrollWidth ${el.scrollWidth}px`
                        + ` > clientWidth ${el.clientWidth}px`);
                const tag = `<${el.tagName.toLowerCase()} class="${el.className}">`;
                const text = el.innerText.replace(/\s+/g, ' ').trim().slice(0, 60);
                return why.length > 1
                    ? [`${tag} ${JSON.stringify(text)}: ${why.join(', ')}`] : [];
            });
        }""",
        [COLUMN, WIDE],
    )
    _fail_if(wide, f"{opened.path}: {len(wide)} elements wider than the content column")


def test_figure_captions_carry_no_book_wide_number(opened: Opened):
    # Sphinx numbers figures across the whole book; no page refers to one by number.
    numbered = opened.page.evaluate(
        """() => Array.from(document.querySelectorAll('figcaption'))
            .map(c => c.innerText.trim()).filter(t => /^Fig\\.\\s*\\d/.test(t))"""
    )
    _fail_if(numbered, f"{opened.path}: figure captions show a number")


def test_internal_links_resolve(opened: Opened, built_site: Path):
    hrefs = opened.page.evaluate(
        "() => Array.from(document.querySelectorAll('a[href]'),"
        " a => [a.getAttribute('href'), a.href])"
    )
    site = built_site.resolve()
    broken = []
    for href, url in hrefs:
        parts = urlsplit(url)
        if parts.scheme != "file":
            continue  # http(s), mailto, javascript: not ours to check offline
        target = Path(unquote(parts.path)).resolve()
        if target.is_dir():
            target = target / "index.html"
        if not target.is_file() or not target.is_relative_to(site):
            broken.append(f"{href}: no such file in the site")
        elif parts.fragment and target.suffix == ".html":
            if unquote(parts.fragment) not in _anchors(target):
                broken.append(
                    f"{href}: no id {unquote(parts.fragment)!r} in {target.name}"
                )
    _fail_if(broken, f"{opened.path}: broken internal links")


def test_no_unresolved_glue(opened: Opened, built_site: Path):
    text = opened.page.evaluate("document.body.innerText")
    problems = [f"{m!r} in the visible text" for m in GLUE_MARKERS if m in text]
    stem = opened.path.removesuffix(".html")
    sources = [built_site / "_sources" / f"{stem}{ext}" for ext in (".ipynb", ".md")]
    roles = sum(_glue_roles(s) for s in sources if s.exists())
    pasted = opened.page.locator(f"{COLUMN} .pasted-text").count()
    if pasted != roles:
        problems.append(
            f"{roles} {{glue:text}} roles in the source but {pasted} values in the "
            "page: "
            "a missing glue key renders as nothing (see the build's mystnb.glue "
            "warnings)"
        )
    _fail_if(problems, f"{opened.path}: unresolved glue")
