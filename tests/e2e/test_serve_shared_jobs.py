"""Two `ember serve` nodes sharing one PostgreSQL job store (`--jobs-url`): a job accepted by a busy node runs
on the other, and either node answers for it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ember.testing import postgres
from ember.testing.server import EmberServer, wait_for

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def jobs_url() -> Iterator[str]:
    if not postgres.available():
        pytest.fail("PostgreSQL is not installed: run `make system` (apt-get install postgresql)")
    with postgres.PostgresServer() as server:
        yield server.create_database("jobs")


def sleep(server: EmberServer, seconds: float, prefer_async: bool = False) -> httpx.Response:
    body = {"inputs": [{"name": "seconds", "shape": [1], "datatype": "FP32", "data": [seconds]}]}
    headers = {"Prefer": "respond-async"} if prefer_async else {}
    return httpx.post(server.url + "/v2/models/sleeper/infer", json=body, headers=headers, timeout=60)


def test_a_job_accepted_by_a_busy_node_runs_on_the_other(tmp_path: Path, jobs_url: str) -> None:
    args = ("--models", str(FIXTURES / "sleeper.yaml"), "--cpu-slots", "1", "--jobs-url", jobs_url)
    with EmberServer(tmp_path / "a", *args) as a, EmberServer(tmp_path / "b", *args) as b:
        b_pid = sleep(b, 0).json()["outputs"][1]["data"][0]          # b's one instance, warm
        holder = threading.Thread(target=lambda: sleep(a, 4))
        holder.start()
        wait_for(lambda: any(i["state"] == "busy" for i in a.instances("sleeper")))
        accepted = sleep(a, 0.1, prefer_async=True)
        assert accepted.status_code == 202, accepted.text
        location = accepted.headers["location"]
        job = wait_for(lambda: (j := httpx.get(b.url + location).json()).get("status") == "succeeded" and j, 30)
        assert job["response"]["outputs"][1]["data"] == [b_pid]      # b ran it: a's only slice was busy
        assert httpx.get(a.url + location).json()["status"] == "succeeded"
        holder.join(30)
    log = (tmp_path / "a" / f"serve-{a.port}.log").read_text()
    assert "shared PostgreSQL store postgresql://ember@127.0.0.1" in log
