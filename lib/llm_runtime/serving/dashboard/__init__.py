"""The live dashboard: a static page (`static/`) that the server sends at `/dashboard`, drawing `/v1/engine/events`.

No build step and nothing fetched at run time: plain HTML, CSS and JavaScript drawing on canvases. The page needs
no more than the events; `engine_events.py` says what they hold.

`headless_page` opens the page in a headless Chromium (Playwright driving the system's browser: Debian's
`chromium` package; Playwright's own browser download is not needed) for the lesson's screenshot, the browser
test and `scripts/dashboard_benchmark.py`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

__all__ = ["STATIC_DIR", "browser_unavailable_reason", "find_chromium", "headless_page"]

STATIC_DIR = Path(__file__).parent / "static"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_ARGS = ("--disable-gpu", "--disable-accelerated-2d-canvas")


def find_chromium() -> str | None:
    """The browser to drive: $LLM_RUNTIME_CHROMIUM if set, else the first of CHROMIUM_NAMES on the PATH."""
    given = os.environ.get("LLM_RUNTIME_CHROMIUM")
    if given:
        return given if Path(given).exists() else None
    return next((path for path in map(shutil.which, CHROMIUM_NAMES) if path), None)


def browser_unavailable_reason() -> str | None:
    """Why `headless_page` cannot run here (None: it can)."""
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (it comes with the [lessons] extra)"
    if find_chromium() is None:
        return ("no Chromium found (install Debian's `chromium` package, as .ci/run does, or set "
                "LLM_RUNTIME_CHROMIUM to a Chromium or Chrome executable)")
    return None


@asynccontextmanager
async def headless_page(url: str, width: int = 1400, height: int = 900) -> AsyncIterator[Any]:
    """A Playwright page with `url` loaded in a headless Chromium; its console errors and page errors are
    collected in `page.errors` (a list of strings)."""
    from playwright.async_api import async_playwright

    reason = browser_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    async with async_playwright() as playwright:
        # --no-sandbox: Chromium's sandbox needs user namespaces, which containers (and root) often lack.
        browser = await playwright.chromium.launch(executable_path=find_chromium(), args=["--no-sandbox", *CHROMIUM_ARGS])
        try:
            page = await browser.new_page(viewport={"width": width, "height": height})
            page.errors = []
            page.on("console", lambda message: page.errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: page.errors.append(str(error)))
            await page.goto(url)
            yield page
        finally:
            await browser.close()
