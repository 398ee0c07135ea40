"""A real `ember serve` against the second round of hardening: Host checks (DNS rebinding), one server per
state dir, graceful drains on SIGTERM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from ember.testing.server import EmberServer, free_port, wait_for

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
