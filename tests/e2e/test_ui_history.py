"""The status page's first visit: `ember serve` keeps the last ten minutes from its start, so the JSON a page
opened now reads (`/ui/data`) holds the samples and the requests of the time before anyone looked."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from ember.testing.server import EmberServer
from ember.wire.contract import example_contracts_dir

pytestmark = pytest.mark.slow

IRIS = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2]}]}


def test_a_first_visit_gets_the_time_before_it(tmp_path: Path) -> None:
    with EmberServer(tmp_path / "state", "--models", str(example_contracts_dir() / "iris.yaml")) as server:
        for _ in range(3):
            r = httpx.post(server.url + "/v2/models/iris/infer", json=IRIS, timeout=90)
            assert r.status_code == 200, r.text
        time.sleep(3)   # nobody looks meanwhile; the server samples every second all the same
        data = httpx.get(server.url + "/ui/data", timeout=10).json()
    samples = data["samples"]
    assert len(samples) >= 3 and data["window_s"] == 600
    assert sum(s["models"].get("iris:1", {}).get("requests", 0) for s in samples) == 3
    assert samples[0]["t"] < samples[-1]["t"] - 1
