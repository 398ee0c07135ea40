"""No capacity: 202 + Location + Retry-After, then polling /v2/jobs/{id} to the result."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from starlette.testclient import TestClient

from ember.jobs.store import JobStore
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


def test_an_idempotency_key_returns_the_same_job_instead_of_queueing_another(
        client: TestClient, service: FakeService, jobs: JobStore) -> None:
    service.no_capacity = True
    first = client.post("/v2/models/affine/infer", json=X, headers={"Idempotency-Key": "order-7"})
    again = client.post("/v2/models/affine/infer", json=X, headers={"Idempotency-Key": '"order-7"'})  # IETF form
    assert first.status_code == again.status_code == 202
    assert again.json()["id"] == first.json()["id"] and again.headers["location"] == first.headers["location"]
    assert jobs.queued_count() == 1 and service.calls[-1].idempotency_key == "order-7"
    other = client.post("/v2/models/affine/infer", json=X, headers={"Idempotency-Key": "order-8"})
    assert other.json()["id"] != first.json()["id"] and jobs.queued_count() == 2
    changed = {"inputs": [{**X["inputs"][0], "data": [9, 9, 9]}]}
    conflict = client.post("/v2/models/affine/infer", json=changed, headers={"Idempotency-Key": "order-7"})
    assert conflict.status_code == 422 and "Idempotency-Key" in conflict.json()["error"]
    r = client.post("/v1/embeddings", json={"input": ["a"], "model": "embedder"},
                    headers={"Prefer": "respond-async", "Idempotency-Key": "emb-1"})
    r2 = client.post("/v1/embeddings", json={"input": ["a"], "model": "embedder"},
                     headers={"Prefer": "respond-async", "Idempotency-Key": "emb-1"})
    assert r.status_code == r2.status_code == 202 and r.json()["id"] == r2.json()["id"]


def test_a_bad_idempotency_key_is_a_400_naming_the_header(client: TestClient) -> None:
    for bad in (b"", b"x" * 256, "caf\u00e9".encode()):
        r = client.post("/v2/models/affine/infer", json=X, headers={"Idempotency-Key": bad})
        assert r.status_code == 400 and "Idempotency-Key" in r.json()["error"], bad


def test_a_failing_job_store_answers_503_with_retry_after_and_no_path(
        client: TestClient, service: FakeService, jobs: JobStore, tmp_path: Path) -> None:
    service.no_capacity = True
    jobs.set_max_bytes(jobs.path.stat().st_size)   # a full disk
    big = {"inputs": [{"name": "x", "shape": [2000, 3], "datatype": "FP32", "data": [1.0] * 6000}]}
    r = client.post("/v2/models/affine/infer", json=big)
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert "disk is full" in r.json()["error"] and str(tmp_path) not in r.text
    r = client.post("/v1/embeddings", json={"input": ["a" * 1000] * 50, "model": "embedder"},
                    headers={"Prefer": "respond-async"})
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "server_error" and str(tmp_path) not in r.text
    jobs.close()
    r = client.get("/v2/jobs/" + "0" * 32)
    assert r.status_code == 503 and "retry-after" in r.headers
