"""Ray's own autoscaler adds and removes the worker (issue 32): from zero workers a request becomes a durable job,
the controller asks Ray for a machine, Ray's `StandardAutoscaler` with its fake multi-node provider starts a
raylet, ember on it deploys the model and runs the job; a request longer than Ray's idle timeout keeps the worker
(it holds its Ray bundle while busy), and once idle Ray removes it. All of it in PID, mount and network
namespaces of its own (`ember.cluster.autoscaling.namespaced`: the fake provider is cleaned up by `ray stop
--force`), one PostgreSQL job store inside them. The scenario is `ember.testing.autoscale`; its timings are
bench/autoscale.py's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

from ember.cluster.autoscaling import namespace_unavailable
from ember.testing import postgres

pytestmark = pytest.mark.slow

SLEEPER = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "sleeper.yaml"
IDLE_TIMEOUT_S, BUSY_S = 6.0, 8.0


def test_ray_autoscaler_adds_a_worker_for_a_job_keeps_it_while_busy_and_removes_it_when_idle(tmp_path: Path) -> None:
    why = namespace_unavailable()
    if why is not None:
        pytest.skip(f"namespaces of its own: {why}")
    if not postgres.available():
        pytest.fail("PostgreSQL is not installed: run `make system`")
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, "-m", "ember.testing.autoscale", "--model", str(SLEEPER),
                          "--root", str(tmp_path / "cluster"), "--out", str(out), "--rounds", "1",
                          "--idle-timeout-s", str(IDLE_TIMEOUT_S), "--busy-s", str(BUSY_S), "--timeout-s", "90"],
                         capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text()) if out.exists() else {"error": run.stdout[-2000:] + run.stderr[-2000:]}
    assert "error" not in result, result.get("error")
    (one,) = result["rounds"]
    events = one["events"]
    # The job was accepted with no worker; the controller asked Ray, whose autoscaler added exactly one raylet.
    assert one["workers_launched"] == 1
    assert events["asked"] < events["raylet"] < events["answered"]
    assert one["job"]["status"] == "succeeded"
    assert one["job"]["response"]["outputs"][0]["data"] == [0.0]
    # The worker held its bundle before the job ran, and stayed through a request longer than the idle timeout.
    assert events["held"] <= events["answered"]
    assert one["busy_status"] == 200 and one["busy_outputs"]["outputs"][0]["data"] == [BUSY_S]
    assert one["survived_busy"]
    # Idle again: bundle released, request withdrawn, and Ray removed the worker after its idle timeout.
    assert events["busy_done"] < events["released"] < events["zero"]
    assert events["zero"] - events["released"] >= IDLE_TIMEOUT_S - 1.0   # not before Ray's idle timeout
    assert "withdrawn" in events
