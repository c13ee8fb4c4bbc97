"""Debian's chromium, driven by Debian's chromium-driver through Selenium (``make apt`` installs
both; selenium is pinned in requirements/engine.lock): the incident-view browser tests of
every layer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
MISSING = "Debian's chromium and chromium-driver are not installed (make apt installs them)"


def available() -> bool:
    return os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)


def browser(headers: dict | None = None):
    """A headless chromium; ``headers`` (a bearer token) go on every request it makes."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1300,1000",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(20)
    if headers:  # a browser cannot put a bearer token on a plain navigation: the DevTools protocol can
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": headers})
    return driver


def keep_screenshot(driver, path: Path) -> Path:
    """Save a screenshot at ``path``, and copy it to $KVGUARD_TEST_ARTIFACTS when that is set."""
    assert driver.save_screenshot(str(path)) and path.stat().st_size > 10_000
    artifacts = os.environ.get("KVGUARD_TEST_ARTIFACTS")
    if artifacts:
        os.makedirs(artifacts, exist_ok=True)
        shutil.copy(path, artifacts)
    return path
