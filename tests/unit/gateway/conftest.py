"""A gateway over a FakeService (with a real JobStore), driven in-process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from ember.gateway.app import create_app
from ember.jobs.store import JobStore
from ember.metrics import Metrics
from ember.testing.service import FakeService

MAX_BODY = 256 * 1024


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[JobStore]:
    with JobStore(tmp_path / "jobs.sqlite3", max_queued=3, result_ttl_s=60.0) as store:
        yield store


@pytest.fixture
def service(jobs: JobStore) -> FakeService:
    return FakeService(jobs=jobs)


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def client(service: FakeService, metrics: Metrics) -> Iterator[TestClient]:
    with TestClient(create_app(service, metrics, max_body_bytes=MAX_BODY)) as c:
        yield c
