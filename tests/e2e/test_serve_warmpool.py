"""A real `ember serve --idle-memory-mb` with two small models (copies of the bundled iris example) and a budget
for one idle instance: the LP planner keeps the one with the higher forecast demand and recycles the other."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest

from ember.testing.server import EmberServer, wait_for
from ember.wire.contract import example_contracts_dir

pytestmark = pytest.mark.slow

FEATURES = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [5.1, 3.5, 1.4, 0.2]}]}


def _models(tmp: Path) -> list[str]:
    examples = example_contracts_dir()
    shutil.copytree(examples / "iris_softmax", tmp / "iris_softmax")
    paths = []
    for name in ("iris-a", "iris-b"):
        text = (examples / "iris.yaml").read_text().replace("name: iris\n", f"name: {name}\n")
        path = tmp / f"{name}.yaml"
        path.write_text(text)
        paths.append(str(path))
    return paths


def _idle(server: EmberServer, model: str) -> int:
    return sum(1 for i in server.instances(model) if i["state"] in ("idle", "paused"))


def test_a_budget_for_one_idle_instance_keeps_the_busier_model(tmp_path: Path) -> None:
    a, b = _models(tmp_path / "models")
    # Each iris instance is 128 MB; 200 MB holds one. At 1e7 MB*s per second of start latency an instance likely
    # to be called within the minute is worth its memory, so the budget decides between the two.
    args = ("--models", a, "--models", b, "--cpu-slots", "2", "--idle-memory-mb", "200",
            "--idle-latency-value", "1e7")
    with EmberServer(tmp_path / "state", *args) as server:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert client.post("/v2/models/iris-b/infer", json=FEATURES).status_code == 200
            for _ in range(15):      # iris-a is called every 0.3 s: its next call is near-certain within the minute
                assert client.post("/v2/models/iris-a/infer", json=FEATURES).status_code == 200
                time.sleep(0.3)
        wait_for(lambda: _idle(server, "iris-b") == 0, timeout=20)
        assert _idle(server, "iris-a") == 1
        assert "warm pool" in server.log.read_text()
