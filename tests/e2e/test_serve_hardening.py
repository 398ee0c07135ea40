"""A real `ember serve` against the second round of hardening: Host checks (DNS rebinding), one server per
state dir, graceful drains on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ember.jobs.store import JobStore
from ember.ports import free_port
from ember.testing.server import EmberServer, wait_for

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
SLEEPER = str(FIXTURES / "sleeper.yaml")


def sleep_for(seconds: float) -> dict[str, object]:
    return {"inputs": [{"name": "seconds", "shape": [1], "datatype": "FP32", "data": [seconds]}]}


def test_a_dns_rebinding_page_cannot_unload_a_model_from_a_server_without_keys(tmp_path: Path) -> None:
    with EmberServer(tmp_path / "state", "--models", SLEEPER, "--cpu-slots", "1",
                     "--allowed-hosts", "ember.lan") as server:
        unload = server.url + "/v2/repository/models/sleeper/unload"
        evil = {"Host": f"evil.example:{server.port}", "Origin": f"http://evil.example:{server.port}"}
        r = httpx.post(unload, json={}, headers=evil)
        assert r.status_code == 403 and "Host: 'evil.example" in r.json()["error"]
        assert httpx.get(server.url + "/v2/models/sleeper/ready").status_code == 200   # still loaded
        for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", "ember.lan"):
            r = httpx.post(server.url + "/v2/models/sleeper/infer", json=sleep_for(0), headers={"Host": host})
            assert r.status_code == 200, host
        assert "Host check: IP addresses and" in server.log.read_text()


def test_a_second_server_on_the_same_state_dir_refuses_and_the_first_ones_jobs_run_once(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with EmberServer(state, "--models", SLEEPER, "--cpu-slots", "1") as server:
        assert server.proc is not None
        r = httpx.post(server.url + "/v2/models/sleeper/infer", json=sleep_for(2),
                       headers={"Prefer": "respond-async"})
        assert r.status_code == 202
        job = server.url + r.headers["location"]
        wait_for(lambda: httpx.get(job).json()["status"] == "running")
        second = subprocess.run([sys.executable, "-m", "ember", "serve", "--port", str(free_port()), "--state-dir",
                                 str(state), "--models", SLEEPER, "--no-examples", "--cpu-slots", "1"],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 2
        assert f"--state-dir {state}: in use by another ember serve (pid {server.proc.pid})" in second.stderr
        done = wait_for(lambda: (b := httpx.get(job).json())["status"] == "succeeded" and b, timeout=30)
        assert done["status"] == "succeeded"
        assert "requeued" not in server.log.read_text()


def _submit(server: EmberServer, seconds: float) -> str:
    r = httpx.post(server.url + "/v2/models/sleeper/infer", json=sleep_for(seconds),
                   headers={"Prefer": "respond-async"})
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def _states(state: Path, *job_ids: str) -> list[str]:
    with JobStore(state / "jobs.sqlite3", max_queued=10, result_ttl_s=3600) as store:
        return [store.get(job_id).state for job_id in job_ids]


def test_sigterm_drains_running_jobs_within_the_grace_and_claims_no_more(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with EmberServer(state, "--models", SLEEPER, "--cpu-slots", "1", "--shutdown-grace-s", "20") as server:
        running, waiting = _submit(server, 3), None
        wait_for(lambda: httpx.get(f"{server.url}/v2/jobs/{running}").json()["status"] == "running")
        waiting = _submit(server, 0.1)      # the one instance is busy: it waits in the queue
        start = time.monotonic()
        assert server.stop(signal.SIGTERM) in (0, -signal.SIGTERM)   # uvicorn re-raises the signal it handled
        took = time.monotonic() - start
    assert _states(state, running, waiting) == ["succeeded", "queued"]   # finished, not cut off; none claimed
    assert 1.0 < took < 15, took
    log = server.log.read_text()
    assert "waiting up to" in log and "1 job(s) finished, 0 still running" in log and "cut off" not in log


def test_a_job_longer_than_the_grace_goes_back_to_the_queue_and_runs_after_a_restart(tmp_path: Path) -> None:
    state = tmp_path / "state"
    args = ("--models", SLEEPER, "--cpu-slots", "1", "--shutdown-grace-s", "1")
    with EmberServer(state, *args) as server:
        job = _submit(server, 8)
        wait_for(lambda: httpx.get(f"{server.url}/v2/jobs/{job}").json()["status"] == "running")
        start = time.monotonic()
        assert server.stop(signal.SIGTERM) in (0, -signal.SIGTERM)   # uvicorn re-raises the signal it handled
        took = time.monotonic() - start
    assert _states(state, job) == ["queued"] and took < 6, took       # given back at once, not left "running"
    assert "1 running job(s) cut off, 1 put back in the queue" in server.log.read_text()
    with EmberServer(state, *args) as again:
        done = wait_for(lambda: (b := httpx.get(f"{again.url}/v2/jobs/{job}").json())["status"] == "succeeded"
                        and b, timeout=30)
        assert done["response"]["outputs"][0]["data"] == [8.0]
