"""A real `ember serve` against the second round of hardening: Host checks (DNS rebinding), one server per
state dir, graceful drains on SIGTERM."""

from __future__ import annotations

from pathlib import Path

import httpx

from ember.testing.server import EmberServer

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
