"""Headless Chromium for the browser tests: the system's browser and driver, nothing fetched.

``start_chromium(window, script_timeout)`` starts one driver (quit when the test module
ends); both test modules take their ``browser`` fixture from it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
except ImportError as e:  # a failure, not a skip: make test-browser installs it
    raise ImportError(f"{e}; the browser test needs selenium in .venv: run `make test-browser` "
                      "(it installs it) or `.venv/bin/pip install selenium`") from e

SHOTS = Path(__file__).resolve().parents[2] / "build" / "browser"
CHROMIUM = os.environ.get("CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER",
                              shutil.which("chromedriver") or "/usr/bin/chromedriver")
APT_LINE = "apt-get install -y chromium chromium-driver"


@pytest.fixture(scope="module")
def start_chromium():
    """A function ``(window "W,H", script_timeout s) -> driver``; its drivers quit after the
    module. Screenshots go to ``SHOTS``, created here."""
    drivers = []

    def start(window: str, script_timeout: float):
        for path, pkg in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
            if not Path(path).exists():
                pytest.fail(f"{path} not found ({pkg}); install the system browser: {APT_LINE}")
        opts = webdriver.ChromeOptions()
        opts.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                    "--disable-gpu", f"--window-size={window}", "--no-first-run",
                    "--disable-extensions"):
            opts.add_argument(arg)
        # an explicit driver path: selenium-manager then fetches nothing
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
        drivers.append(driver)
        driver.set_script_timeout(script_timeout)
        SHOTS.mkdir(parents=True, exist_ok=True)
        return driver

    yield start
    for driver in drivers:
        driver.quit()
