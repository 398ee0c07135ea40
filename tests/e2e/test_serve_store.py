"""`ember serve` with a store-backed model: the first request fetches the weights from a real nginx origin."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ember.store import StoreConfig, WeightStore
from ember.testing.models import minilm_dir, store_backed_minilm
from ember.testing.nginx import NginxOrigin, available
from ember.testing.server import EmberServer

pytestmark = pytest.mark.slow

BODY = {"model": "minilm-remote", "input": ["weights from a store", "fetched once"]}


@pytest.fixture
def base() -> Iterator[Path]:
    # Unix socket paths are short: the state dir sits directly under /tmp.
    path = Path(tempfile.mkdtemp(prefix="ember-e2e-store-", dir="/tmp"))
    yield path
    memory = StoreConfig(root=path / "node").memory_dir
    shutil.rmtree(path, ignore_errors=True)
    if memory is not None:
        shutil.rmtree(memory, ignore_errors=True)


def test_the_first_request_takes_the_fetch_rung_then_the_instance_is_hot(base: Path) -> None:
    if not available():
        pytest.skip("nginx is not installed (make system)")
    with WeightStore(StoreConfig(root=base / "origin", memory_dir=None)) as publisher:
        publisher.push(minilm_dir(), "minilm:1")
    models = store_backed_minilm(base / "models", "minilm-remote", "remote.yaml").parent
    with NginxOrigin(base / "origin") as origin, \
            EmberServer(base / "state", "--models", str(models), "--store-root", str(base / "node"),
                        "--store-origin", origin.url) as server:
        assert [p for p in origin.requests() if "/chunks/" in p] == []  # ready without fetching anything
        first = httpx.post(server.url + "/v1/embeddings", json=BODY, timeout=120)
        assert first.status_code == 200, first.text
        assert first.headers["ember-rung"] == "fetch"
        assert len(first.json()["data"]) == 2 and len(first.json()["data"][0]["embedding"]) == 384
        fetched = [p for p in origin.requests() if "/chunks/" in p]
        assert fetched and len(set(fetched)) == len(fetched)
        second = httpx.post(server.url + "/v1/embeddings", json=BODY, timeout=120)
        assert second.headers["ember-rung"] == "hot"
        assert second.json()["data"] == first.json()["data"]
        (model,) = server.status()["models"]
        assert model["instances"][0]["rung"] == "fetch"
        metrics = httpx.get(server.url + "/metrics").text
        assert ('ember_ladder_time_to_first_response_seconds_count{model="minilm-remote",rung="fetch",version="1"} 1.0'
                in metrics)
        phase = 'ember_cold_start_phase_seconds_count{model="minilm-remote",phase="fetch",rung="fetch",version="1"}'
        assert f"{phase} 1.0" in metrics
