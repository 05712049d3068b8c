"""A real headless browser for the dashboard's tests: Debian's ``chromium`` (the Makefile's test
set-up installs it) driven by Playwright for Python, which never downloads a browser of its own."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from playwright.async_api import Page, async_playwright

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@dataclass
class BrowserPage:
    page: Page
    console_errors: list[str] = field(default_factory=list)


@contextlib.asynccontextmanager
async def browser_page(width: int = 1400, height: int = 1200) -> AsyncIterator[BrowserPage]:
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed: `make test` installs it (apt-get install chromium)")
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = await browser.new_page(viewport={"width": width, "height": height})
            out = BrowserPage(page)
            page.on("console", lambda msg: out.console_errors.append(msg.text) if msg.type == "error" else None)
            page.on("pageerror", lambda exc: out.console_errors.append(f"page error: {exc}"))
            yield out
        finally:
            await browser.close()
