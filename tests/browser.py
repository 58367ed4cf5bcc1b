"""A real headless Chromium for the review pages' tests, driven by Selenium through chromedriver.

Both come from Debian (``chromium``, ``chromium-driver``: one version, so the driver always
matches the browser; ``make test`` installs them, see tests/install_browser.sh). Selenium is
told where they are, so it never downloads a browser or a driver (this machine has no network).
Missing outside CI: the tests skip and say why; under ``CI=true`` they fail instead.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

CHROMIUM = os.environ.get("VISBATCH_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("VISBATCH_TEST_CHROMEDRIVER", "/usr/bin/chromedriver")
# Root needs --no-sandbox; the rest keeps a closed-network machine from waiting on Google services.
FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
]


def browser_missing_reason() -> str | None:
    missing = [
        path for path in (CHROMIUM, CHROMEDRIVER) if not (os.path.isfile(path) and os.access(path, os.X_OK))
    ]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install chromium chromium-driver, or make test)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    return None


def require_browser() -> None:
    reason = browser_missing_reason()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: the browser tests must run, not skip)", pytrace=False)
    pytest.skip(reason)


@contextmanager
def chromium() -> Iterator[Any]:
    """A fresh headless Chromium (its own profile folder, removed afterwards)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    require_browser()
    profile = tempfile.mkdtemp(prefix="visbatch-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_for(condition: Any, timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def load_all_images(driver: Any) -> list[dict[str, Any]]:
    """Scroll every image into view (they load lazily), wait until each is complete, and return
    their sources and natural widths (0: the browser could not load or decode it)."""
    images = driver.find_elements("css selector", "img")
    for image in images:
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", image)
        wait_for(
            lambda image=image: driver.execute_script("return arguments[0].complete;", image), what="image"
        )
    driver.execute_script("window.scrollTo(0, 0);")
    return [
        driver.execute_script(
            "return {src: arguments[0].currentSrc, width: arguments[0].naturalWidth};", image
        )
        for image in images
    ]
