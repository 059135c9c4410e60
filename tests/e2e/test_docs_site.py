"""The docs site as a reader sees it, in a real browser: ``mkdocs build`` once, the site
served on 127.0.0.1, every page loaded in headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by Selenium) 1280 and 390 px wide, in one browser session.

On every page, at both widths:

* no code block is cut off: one wider than its box scrolls (``overflow-x`` auto or
  scroll), and a block of code to read and copy (shell, Python, SQL, configuration:
  class ``wrap`` from ``docs/_ext/hooks.py``) wraps, so that it is seen whole without
  scrolling (getting-started's command 1 is wider than the page at 1280 px);
* no name is split across lines: inline code without spaces in a table (the theme
  breaks inline code anywhere: "connection_o" / "ptions"), and no word with a hyphen in
  a wrapped code block (``-m``, ``kombu-pgmq``);
* the page is not wider than the window.

The home page's "Where to go next" links Results, Beat, Limits and Troubleshooting.
A screenshot of each page at each width (the window, 900 px high: the page's top, or its
first problem outlined in red) goes to ``$KOMBU_PGMQ_SCREENSHOTS/docs_site/`` when that
variable is set, else to the test's temporary directory. The browser resolves no host but
127.0.0.1 (the theme's web fonts fall back to local ones): the test never touches the
network.
Skipped, saying why, without Chromium and chromedriver or without MkDocs (extra ``docs``).
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.helpers import REPO_ROOT

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
WIDTHS = (1280, 390)
#: Height of the window (px): what a screenshot shows.
WINDOW_HEIGHT = 900

pytestmark = [
    pytest.mark.skipif(
        not (CHROMIUM and CHROMEDRIVER),
        reason="needs Debian's chromium and chromium-driver "
        "(apt-get install chromium chromium-driver)",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("mkdocs") is None,
        reason="needs MkDocs to build the site (pip install -e '.[docs]')",
    ),
]

#: Problems of the page the browser shows, one line each (empty: none; each element at
#: fault outlined in red, the first scrolled into view); and how many code blocks of
#: class ``wrap`` and names it checked.
CHECK_PAGE = r"""
const problems = [];
const bad = [];
const report = (el, problem) => { problems.push(problem); bad.push(el); };
const first = (el) => el.textContent.trim().split("\n")[0].slice(0, 70);
const page = document.documentElement;
if (page.scrollWidth > page.clientWidth + 1) {
  problems.push(`the page is wider than the window (${page.scrollWidth} > ${page.clientWidth} px)`);
}
for (const code of document.querySelectorAll("pre > code")) {
  if (code.scrollWidth <= code.clientWidth + 1) continue;
  const overflow = getComputedStyle(code).overflowX;
  if (!["auto", "scroll"].includes(overflow)) {
    report(code, `code block cut off without a scrollbar (overflow-x: ${overflow}): ` +
                 first(code));
  } else if (code.closest(".highlight.wrap")) {
    report(code, `code block to read scrolls instead of wrapping (${code.scrollWidth} > ` +
                 `${code.clientWidth} px): ${first(code)}`);
  }
}
const names = [...document.querySelectorAll("table code, .highlight.wrap .word")]
  .filter((code) => !/\s/.test(code.textContent));
for (const code of names) {
  const lines = code.getClientRects().length;
  if (lines > 1) report(code, `name split over ${lines} lines: ${code.textContent}`);
}
// Outlined in red, the first one in view: the screenshot taken next shows it.
for (const el of bad) el.style.outline = "3px solid red";
if (bad.length) bad[0].scrollIntoView({block: "center"});
return {
  problems: problems,
  wrapped: document.querySelectorAll(".highlight.wrap pre > code").length,
  names: names.length,
};
"""

#: Where the home page's "Where to go next" list links to.
NEXT_LINKS = r"""
const heading = document.getElementById("where-to-go-next");
let list = heading && heading.nextElementSibling;
while (list && list.tagName !== "UL") list = list.nextElementSibling;
return list ? [...list.querySelectorAll("a")].map((a) => a.getAttribute("href")) : [];
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The docs site, built once (``mkdocs build --strict``)."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO_ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """Base URL of the site served on 127.0.0.1 (a thread of this process)."""

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass  # no access log on stderr

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(site))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # never download a driver
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-dev-shm-usage",
        "--no-first-run",
        # The site only: the theme's Google Fonts fail at once instead of waiting on DNS.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        f"--window-size={WIDTHS[0]},{WINDOW_HEIGHT}",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _pages(site: Path) -> list[str]:
    """Every page of the site, as a path relative to its root (``""``: the home page)."""
    pages = []
    for index in sorted(site.rglob("index.html")):
        relative = index.parent.relative_to(site).as_posix()
        pages.append("" if relative == "." else relative + "/")
    return pages


@pytest.mark.slow
def test_every_page_shows_its_code_whole_at_1280_and_390_px(
    site: Path, served: str, browser: Any, tmp_path: Path
) -> None:
    shots = Path(os.environ.get("KOMBU_PGMQ_SCREENSHOTS") or tmp_path) / "docs_site"
    shots.mkdir(parents=True, exist_ok=True)
    pages = _pages(site)
    assert "getting-started/" in pages and "guides/celery/" in pages, pages
    problems: list[str] = []
    wrapped: dict[tuple[int, str], int] = {}
    names = 0
    for width in WIDTHS:
        browser.set_window_size(width, WINDOW_HEIGHT)
        for page in pages:
            browser.get(served + page)
            found = browser.execute_script(CHECK_PAGE)
            problems += [f"{width} px, /{page}: {problem}" for problem in found["problems"]]
            wrapped[width, page] = found["wrapped"]
            names += found["names"]
            slug = page.strip("/").replace("/", "_") or "index"
            # what a reader sees first or, on a page with a problem, the first problem
            problem = "_problem" if found["problems"] else ""
            assert browser.save_screenshot(str(shots / f"{width}_{slug}{problem}.png"))
    assert problems == [], "\n".join(problems) + f"\n(screenshots: {shots})"
    # What was checked exists: the getting-started page's commands and Python are blocks
    # that wrap (two commands, the app, its commands), the tables hold names.
    assert all(wrapped[width, "getting-started/"] >= 4 for width in WIDTHS), wrapped
    assert names > 500, names

    browser.get(served)
    links = browser.execute_script(NEXT_LINKS)
    for target in ("results/", "beat/", "limits/", "troubleshooting/"):
        assert target in links, (target, links)
