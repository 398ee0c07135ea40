"""Debian's chromium, headless, driven by Selenium through chromium-driver: the status page's browser."""

from __future__ import annotations

import shutil
from typing import Any

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def installed() -> bool:
    return bool(shutil.which("chromium") and shutil.which("chromedriver"))


def headless_chromium(width: int = 1400, height: int = 1000) -> Any:
    """A selenium WebDriver (quit() it). The driver is named, so Selenium Manager never goes online for one."""
    from selenium import webdriver  # a test extra: imported here, so ember.testing loads without it
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--hide-scrollbars"):
        options.add_argument(arg)   # --no-sandbox: CI runs as root, where chromium's sandbox refuses to start
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})   # the page's console, for driver.get_log
    return webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
