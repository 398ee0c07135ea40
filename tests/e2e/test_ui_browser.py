"""The status page in a real browser: headless chromium against a real `ember serve` with the bundled models."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ember.testing import browser
from ember.testing.server import EmberServer

pytestmark = pytest.mark.slow

IRIS = {"inputs": [{"name": "features", "shape": [2, 4], "datatype": "FP32",
                    "data": [5.1, 3.5, 1.4, 0.2, 6.7, 3.0, 5.2, 2.3]}]}
WAIT_S = 90   # generous: a cold start of iris on a busy CI machine; nothing here asserts speed


@pytest.fixture
def driver() -> Iterator[Any]:
    if not browser.installed():
        pytest.skip("chromium and chromium-driver are not installed (make system)")
    d = browser.headless_chromium()
    yield d
    d.quit()


def test_the_page_lists_the_models_and_its_latency_plot_moves_with_a_request(
        examples_server: EmberServer, driver: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, WAIT_S, poll_frequency=0.2)
    driver.get(examples_server.url + "/ui")
    def cards(d: Any) -> dict[str, str]:
        return {e.get_attribute("data-model"): e.find_element(By.CSS_SELECTOR, ".name").text
                for e in d.find_elements(By.CSS_SELECTOR, "article.model")}

    shown = wait.until(lambda d: cards(d) if {"minilm:1", "iris:1", "smollm2:1"} <= set(cards(d)) else None)
    assert shown["iris:1"] == "iris" and shown["minilm:1"] == "minilm"
    latency = '[data-model="iris:1"] canvas.latency'

    def points() -> int:
        return int(driver.find_element(By.CSS_SELECTOR, latency).get_attribute("data-points") or 0)

    before = points()
    r = httpx.post(examples_server.url + "/v2/models/iris/infer", json=IRIS, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    wait.until(lambda _: points() > before)
    # The rung strip of iris's card shows where it was served.
    served = 'article[data-model="iris:1"] .rungs span[data-rung]:not([data-rung=""])'
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, served))
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    assert "disconnected" not in driver.find_element(By.ID, "updated").text
