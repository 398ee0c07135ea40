"""Real processes failing: a worker SIGKILLed mid-request, a server restarted with a queued job."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from ember.testing.server import EmberServer, wait_for

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"

pytestmark = pytest.mark.slow


def sleep_request(seconds: float, prefer_async: bool = False) -> tuple[dict[str, Any], dict[str, str]]:
    body = {"inputs": [{"name": "seconds", "shape": [1], "datatype": "FP32", "data": [seconds]}]}
    headers = {"Prefer": "respond-async"} if prefer_async else {}
    return body, headers


def post_sleep(server: EmberServer, seconds: float, **kw: bool) -> httpx.Response:
    body, headers = sleep_request(seconds, **kw)
    return httpx.post(server.url + "/v2/models/sleeper/infer", json=body, headers=headers, timeout=60)


def test_a_worker_killed_mid_request_is_retried_on_a_new_instance(tmp_path: Path) -> None:
    with EmberServer(tmp_path, "--models", str(FIXTURES / "sleeper.yaml")) as server:
        warm = post_sleep(server, 0)
        assert warm.status_code == 200
        first_pid = warm.json()["outputs"][1]["data"][0]
        result: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: result.setdefault("r", post_sleep(server, 1.5)))
        t.start()
        wait_for(lambda: any(i["state"] == "busy" for i in server.instances("sleeper")))
        os.kill(first_pid, signal.SIGKILL)
        t.join(30)
        response = result["r"]
        assert response.status_code == 200, response.text
        new_pid = response.json()["outputs"][1]["data"][0]
        assert new_pid != first_pid
        assert [i["pid"] for i in server.instances("sleeper")] == [new_pid]
        metrics = httpx.get(server.url + "/metrics").text
        assert 'ember_worker_crashes_total{model="sleeper",version="1"} 1.0' in metrics


def test_a_queued_job_survives_a_restart_of_ember_serve(tmp_path: Path) -> None:
    args = ("--models", str(FIXTURES / "sleeper.yaml"), "--cpu-slots", "1")
    server = EmberServer(tmp_path, *args).start()
    try:
        holder = threading.Thread(target=lambda: post_sleep(server, 4))
        holder.start()
        wait_for(lambda: any(i["state"] == "busy" for i in server.instances("sleeper")))
        accepted = post_sleep(server, 0.1)
        assert accepted.status_code == 202, accepted.text
        assert int(accepted.headers["retry-after"]) >= 1
        location = accepted.headers["location"]
        assert httpx.get(server.url + location).json()["status"] in ("queued", "running")
    finally:
        server.stop()
    holder.join(30)
    with EmberServer(tmp_path, *args) as again:
        job = wait_for(lambda: (j := httpx.get(again.url + location).json()).get("status") == "succeeded" and j, 60)
        assert job["response"]["outputs"][0]["data"] == [pytest.approx(0.1)]


def test_async_requests_and_unknown_jobs(tmp_path: Path) -> None:
    with EmberServer(tmp_path, "--models", str(FIXTURES / "sleeper.yaml")) as server:
        accepted = post_sleep(server, 0.2, prefer_async=True)
        assert accepted.status_code == 202
        job = wait_for(lambda: (j := httpx.get(server.url + accepted.headers["location"]).json())
                       .get("status") == "succeeded" and j)
        assert job["response"]["outputs"][0]["data"] == [pytest.approx(0.2)]
        missing = httpx.get(server.url + "/v2/jobs/0123456789abcdef")
        assert missing.status_code == 404 and "error" in missing.json()
        bad = post_sleep(server, 99)
        assert bad.status_code == 500 and "seconds must lie" not in bad.text     # the model's text: in the log only
        incident = bad.json()["error"].split("incident ")[1].split(";")[0]
        assert any(incident in line and "seconds must lie" in line for line in server.log.read_text().splitlines())
        assert post_sleep(server, 0).status_code == 200


def test_a_killed_template_is_made_again_and_requests_start_from_the_zygote_meanwhile(tmp_path: Path) -> None:
    with EmberServer(tmp_path, "--models", str(FIXTURES / "sleeper.yaml")) as server:
        template_pid = server.status()["models"][0]["template"]["pid"]
        os.kill(template_pid, signal.SIGKILL)
        first = post_sleep(server, 0)   # no instance yet: a fork, never a 503 "no template on this node"
        assert first.status_code == 200, first.text
        # The zygote if it came before the healer's next tick made the template again (the order is a race
        # here; tests/unit/serving/test_healer.py pins both cases down with a fake clock).
        assert first.headers["ember-rung"] in ("zygote", "template")
        assert httpx.get(server.url + "/v2/models/sleeper/ready").status_code == 200
        wait_for(lambda: (server.status()["models"][0]["template"] or {}).get("pid") not in (None, template_pid))
        assert server.status()["models"][0]["state"] == "READY"


def test_a_model_whose_outputs_contradict_its_contract_becomes_unavailable_with_the_reason(tmp_path: Path) -> None:
    with EmberServer(tmp_path, "--models", str(FIXTURES / "mislabelled.yaml"),
                     "--models", str(FIXTURES / "sleeper.yaml")) as server:
        body, _ = sleep_request(0)
        url = server.url + "/v2/models/mislabelled/infer"
        first = httpx.post(url, json=body, timeout=60)
        assert first.status_code == 503
        assert "warm-up: " in first.text and "slept" in first.text and "FP64" in first.text
        again = httpx.post(url, json=body, timeout=60)   # no new fork: the model is unavailable until reloaded
        assert again.status_code == 503 and "FP64" in again.text
        assert server.instances("mislabelled") == []
        assert httpx.get(server.url + "/v2/models/mislabelled/ready").status_code != 200
        index = httpx.post(server.url + "/v2/repository/index", json={}).json()
        (entry,) = [e for e in index if e["name"] == "mislabelled"]
        assert entry["state"] == "UNAVAILABLE" and "FP64" in entry["reason"]
        assert post_sleep(server, 0).status_code == 200   # the other model serves on


def test_a_killed_zygote_takes_its_template_along_and_both_come_back(tmp_path: Path) -> None:
    with EmberServer(tmp_path, "--models", str(FIXTURES / "sleeper.yaml")) as server:
        (zygote,) = server.status()["node"]["zygotes"]
        template_pid = server.status()["models"][0]["template"]["pid"]
        os.kill(zygote["pid"], signal.SIGKILL)
        wait_for(lambda: server.status()["models"][0]["template"] is None)   # it died with its zygote
        answer = post_sleep(server, 0)
        assert answer.status_code == 200, answer.text
        wait_for(lambda: (server.status()["models"][0]["template"] or {}).get("pid") not in (None, template_pid))
        (again,) = server.status()["node"]["zygotes"]
        assert again["pid"] != zygote["pid"]


def test_a_job_database_with_a_corrupted_header_is_moved_aside_and_serving_starts(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.sqlite3"
    jobs.write_bytes(b"\xde\xad\xbe\xef" * 4096)   # what was a job database, its header gone
    with EmberServer(tmp_path, "--models", str(FIXTURES / "sleeper.yaml")) as server:
        assert post_sleep(server, 0).status_code == 200
        accepted = post_sleep(server, 0.1, prefer_async=True)
        assert accepted.status_code == 202
        wait_for(lambda: httpx.get(server.url + accepted.headers["location"]).json().get("status") == "succeeded")
        log = server.log.read_text()
        assert "is damaged (file is not a database): moved aside to" in log
    (aside,) = tmp_path.glob("jobs.sqlite3.damaged-*")
    assert aside.read_bytes()[:4] == b"\xde\xad\xbe\xef"
    assert jobs.stat().st_mode & 0o777 == 0o600
