"""No capacity: 202 + Location + Retry-After, then polling /v2/jobs/{id} to the result."""

from __future__ import annotations

import numpy as np
from starlette.testclient import TestClient

from ember.testing.service import FakeService

X = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}


def test_no_capacity_answers_202_then_the_job_succeeds(client: TestClient, service: FakeService) -> None:
    service.no_capacity = True
    service.job_retry_after_s = 0.3
    r = client.post("/v2/models/affine/infer", json=X)
    assert r.status_code == 202
    body = r.json()
    assert r.headers["location"] == f"/v2/jobs/{body['id']}" == body["location"]
    assert r.headers["retry-after"] == "1" and body["retry_after"] == 1
    assert body["status"] == "queued" and body["model_name"] == "affine"
    polled = client.get(r.headers["location"]).json()
    assert polled["status"] == "queued" and "response" not in polled
    assert service.run_jobs() == 1
    done = client.get(r.headers["location"]).json()
    assert done["status"] == "succeeded" and done["finished_at"] >= done["created_at"]
    y = next(o for o in done["response"]["outputs"] if o["name"] == "y")
    assert y["data"] == [3.0, 5.0, 7.0] and y["shape"] == [1, 3]


def test_prefer_respond_async_reaches_the_service(client: TestClient, service: FakeService) -> None:
    r = client.post("/v2/models/affine/infer", json=X, headers={"Prefer": "wait=5, respond-async"})
    assert r.status_code == 202 and service.calls[-1].respond_async
    client.post("/v2/models/affine/infer", json=X)
    assert not service.calls[-1].respond_async


def test_failed_job_reports_its_error(client: TestClient, service: FakeService) -> None:
    service.no_capacity = True
    location = client.post("/v2/models/affine/infer", json=X).headers["location"]
    service.models = [c for c in service.models if c.name != "affine"]  # the model vanishes before the job runs
    service.run_jobs()
    body = client.get(location).json()
    assert body["status"] == "failed" and "affine" in body["error"]


def test_unknown_job_is_404(client: TestClient) -> None:
    r = client.get("/v2/jobs/" + "0" * 32)
    assert r.status_code == 404 and "no such job" in r.json()["error"]


def test_full_queue_is_429_with_retry_after(client: TestClient, service: FakeService) -> None:
    service.no_capacity = True
    for _ in range(3):  # the fixture's JobStore holds max_queued=3
        assert client.post("/v2/models/affine/infer", json=X).status_code == 202
    r = client.post("/v2/models/affine/infer", json=X)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1 and "max_queued 3" in r.json()["error"]


def test_openai_route_answers_429_when_full_for_clients_that_cannot_poll_a_job(
        client: TestClient, service: FakeService) -> None:
    service.no_capacity = True
    r = client.post("/v1/embeddings", json={"input": ["a", "b"], "model": "embedder"})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert error["type"] == "rate_limit_exceeded" and "every instance is full" in error["message"]
    assert service.calls[-1].when_full == "reject"


def test_openai_route_answers_202_with_location_when_asked_for_async(client: TestClient, service: FakeService) -> None:
    service.no_capacity = True
    r = client.post("/v1/embeddings", json={"input": ["a", "b"], "model": "embedder"},
                    headers={"Prefer": "respond-async"})
    assert r.status_code == 202 and r.headers["location"].startswith("/v2/jobs/")
    service.run_jobs()
    out = client.get(r.headers["location"]).json()["response"]["outputs"]
    emb = next(o for o in out if o["name"] == "embedding")
    assert emb["shape"] == [2, 8] and np.isclose(np.linalg.norm(emb["data"][:8]), 1.0)
