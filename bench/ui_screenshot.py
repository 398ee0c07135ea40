"""Screenshot of the status page (docs/ui.png): `ember serve` with the bundled models, about a minute of light traffic.

Run: .venv/bin/python bench/ui_screenshot.py [--out docs/ui.png] [--seconds 55]. Needs chromium and
chromium-driver (make system).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import httpx

from ember.testing.browser import headless_chromium
from ember.testing.server import EmberServer

IRIS = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2]}]}


def traffic(url: str, seconds: float, stop: threading.Event) -> None:
    """iris a few times a second, with a quiet spell (it pauses, then resumes), and MiniLM now and then."""
    start = time.monotonic()
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set() and (t := time.monotonic() - start) < seconds:
            if not 0.4 * seconds < t < 0.6 * seconds:
                client.post("/v2/models/iris/infer", json=IRIS)
            if int(t * 4) % 7 == 0:
                client.post("/v1/embeddings", json={"model": "minilm", "input": f"a status page, second {t:.0f}"})
            time.sleep(0.25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/ui.png"))
    parser.add_argument("--seconds", type=float, default=55.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as state, EmberServer(Path(state)) as server:
        driver = headless_chromium(1400, 1000)
        try:
            driver.get(server.url + "/ui")   # open first: the page's timeline is sampled only while it is looked at
            stop = threading.Event()
            worker = threading.Thread(target=traffic, args=(server.url, args.seconds, stop))
            worker.start()
            worker.join()
            time.sleep(2)
            for _ in range(2):   # the page may grow as it redraws at the new size (a card appears): twice
                # The window's size includes what is not viewport (outer - inner), so add that.
                height = driver.execute_script(
                    "return document.documentElement.scrollHeight + window.outerHeight - window.innerHeight")
                driver.set_window_size(1400, int(height))
                time.sleep(1.5)   # a poll or so, so the canvases are redrawn at the new size
            driver.save_screenshot(str(args.out))
            print(f"wrote {args.out}")
        finally:
            driver.quit()


if __name__ == "__main__":
    main()
