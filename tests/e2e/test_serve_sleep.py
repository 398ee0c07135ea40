"""`ember serve` with a model whose engine has a sleep mode (a python model standing in for vLLM's, which needs a
GPU): idle, its instance is paused, then put to sleep at the contract's `sleep_after_s`; the next request wakes it
and is answered from the `sleep-2` rung, as the response header and the status say."""

from __future__ import annotations

from pathlib import Path

import httpx

from ember.testing.server import EmberServer, wait_for

MODELS = Path(__file__).resolve().parents[1] / "integration" / "node" / "models"
X = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}]}


def test_an_idle_instance_sleeps_and_the_next_request_wakes_it(tmp_path: Path) -> None:
    with EmberServer(tmp_path, "--no-examples", "--models", str(MODELS / "sleeper.yaml"), "--cpu-slots", "1",
                     "--log-level", "warning") as server:
        url = f"{server.url}/v2/models/sleeper/infer"
        first = httpx.post(url, json=X, timeout=60)
        assert first.status_code == 200, first.text
        [inst] = wait_for(lambda: [i for i in server.instances("sleeper") if i["state"] == "asleep"], timeout=20)
        assert inst["sleep_level"] == 2 and inst["held_mb"] > 0
        woken = httpx.post(url, json=X, timeout=60)
        assert woken.status_code == 200, woken.text
        assert woken.headers["ember-rung"] == "sleep-2"
        before, after = first.json()["outputs"][0]["data"], woken.json()["outputs"][0]["data"]
        assert after[:-1] == before[:-1] and (before[-1], after[-1]) == (0, 1)   # its last value: the wakes so far
        [again] = server.instances("sleeper")
        assert again["id"] == inst["id"] and again["state"] in ("idle", "busy")
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'rung="sleep-2"' in metrics
