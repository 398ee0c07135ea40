"""/metrics in Prometheus text format and /ember/status as JSON."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from ember.testing.service import FakeService


def test_metrics_endpoint_counts_requests_by_model_api_code(client: TestClient) -> None:
    x = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
    client.post("/v2/models/affine/infer", json=x)
    client.post("/v2/models/affine/infer", json=x)
    client.post("/v1/embeddings", json={"input": "a", "model": "embedder"})
    client.post("/v2/models/affine/infer", json={"inputs": []})
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    counts = {(s.labels["model"], s.labels["api"], s.labels["code"]): s.value
              for s in families["ember_requests"].samples if s.name == "ember_requests_total"}
    assert counts[("affine", "v2", "200")] == 2
    assert counts[("affine", "v2", "400")] == 1
    assert counts[("embedder", "openai", "200")] == 1
    assert "ember_request_duration_seconds" in families and "ember_ladder_time_to_ready_seconds" in families


def test_status_lists_models_and_instances(client: TestClient, service: FakeService) -> None:
    service.unloaded.add("echo")
    body = client.get("/ember/status").json()
    by_name = {m["name"]: m for m in body["models"]}
    assert set(by_name) == {"embedder", "affine", "chatter", "echo"}
    assert by_name["echo"]["state"] == "unloaded" and by_name["echo"]["instances"] == []
    assert by_name["affine"]["instances"][0]["rung"] == "hot"
    assert body["node"]["zygotes"][0]["runtime"] == "python" and body["node"]["jobs"] == []
