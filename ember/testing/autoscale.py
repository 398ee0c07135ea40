"""The autoscaler scenario (issue 32), run inside namespaces of its own: from zero workers, a request becomes a
durable job, Ray's autoscaler adds a worker, its `ember serve` runs the job, a busy worker outlives Ray's idle
timeout, and once idle the worker is removed. One process does it all and writes what it saw as JSON.

    python -m ember.testing.autoscale --model tests/fixtures/models/sleeper.yaml --out result.json
    (it re-runs itself through `ember.cluster.autoscaling.namespaced`; --inside: already there)

Rounds: each round starts from zero workers. Times are seconds of one monotonic clock, relative to the moment
the round's 202 came back (`accepted`):

    asked       the controller has asked Ray for a machine (`scale_request`)
    raylet      the autoscaler's new raylet is alive (the launcher saw it and started `ember serve` there)
    joined      the head's gateway sees the worker's node
    held        the worker holds its bundle in Ray (`ember-busy-*` placement group created)
    answered    the job's status is `succeeded` (the caller's next poll gets the answer)
    busy_done   a request of `busy_s` (longer than the idle timeout) came back, the worker still there
    released    the worker gave its bundle back (no work for the linger time): Ray's idle clock starts
    withdrawn   the controller's request to Ray is withdrawn (0 nodes)
    zero        no worker raylet is alive
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx


def _poll_until(what: str, check: Callable[[], bool], timeout_s: float, every: Callable[[], None]) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        every()
        time.sleep(0.05)


class Round:
    """One round's timeline: each event's first time, polled."""

    def __init__(self, cluster: Any, accepted: float) -> None:
        self.cluster, self.accepted = cluster, accepted
        self.events: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.events.setdefault(name, round(time.monotonic() - self.accepted, 3))

    def poll(self) -> None:
        import ray
        from ray.util import placement_group_table

        from ember.cluster.actors import CONTROLLER, NAMESPACE

        asked: int = ray.get(ray.get_actor(CONTROLLER, namespace=NAMESPACE).scale_request.remote(), timeout=10)[0]
        if asked > 0:
            self.mark("asked")
        elif "asked" in self.events:
            self.mark("withdrawn")
        alive = self.cluster.alive_workers()
        if alive:
            self.mark("raylet")
        groups = [g for g in placement_group_table().values() if str(g.get("name", "")).startswith("ember-busy-")]
        if any(g["state"] == "CREATED" for g in groups):
            self.mark("held")
        elif "held" in self.events and "busy_done" in self.events:
            self.mark("released")
        if "busy_done" in self.events and not alive:
            self.mark("zero")

    def launched(self) -> int:
        """Raylets the autoscaler added since this round's job was accepted."""
        return sum(1 for w in self.cluster.workers.values() if w.seen_at >= self.accepted)


def joined(url: str) -> bool:
    return nodes_seen(url) >= 2


def nodes_seen(url: str) -> int:
    return len(httpx.get(url + "/ember/status", timeout=5).json()["node"]["cluster"]["nodes"])


def drop_holds(r: Round) -> None:
    """The control: take the worker's bundle away from outside (its node then holds nothing, as before the hold)."""
    from ray.util import placement_group_table, remove_placement_group
    from ray.util.placement_group import PlacementGroup, PlacementGroupID

    for group_id, g in placement_group_table().items():
        if str(g.get("name", "")).startswith("ember-busy-") and g["state"] == "CREATED":
            remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(group_id)))
            r.mark("hold_dropped")


def run_round(cluster: Any, model: str, busy_s: float, timeout_s: float, seen: list[Round],
              control: bool = False) -> dict[str, Any]:
    head = cluster.gateway_url
    # From zero workers in ember's view too: the last round's worker leaves it one report timeout after its raylet.
    _poll_until("the head's view without workers", lambda: nodes_seen(head) == 1, 30, lambda: None)
    body = {"inputs": [{"name": "seconds", "shape": [1], "datatype": "FP32", "data": [0.0]}]}
    queued = httpx.post(f"{head}/v2/models/{model}/infer", json=body, timeout=60)
    r = Round(cluster, time.monotonic())
    seen.append(r)
    if queued.status_code != 202:
        raise RuntimeError(f"expected a 202 job from zero workers, got {queued.status_code}: {queued.text}")
    location = queued.headers["location"]
    job: dict[str, Any] = {}

    def answered() -> bool:
        nonlocal job
        job = httpx.get(head + location, timeout=10).json()
        if job.get("status") == "failed":
            raise RuntimeError(f"the job failed: {job}")
        if "joined" not in r.events and joined(head):
            r.mark("joined")
        return job.get("status") == "succeeded"

    _poll_until("the job's answer", answered, timeout_s, r.poll)
    r.mark("answered")
    serving = cluster.alive_workers()
    # Busy for longer than Ray's idle timeout: the worker must still be there when it answers.
    slow = {"inputs": [{"name": "seconds", "shape": [1], "datatype": "FP32", "data": [busy_s]}]}
    with ThreadPoolExecutor(1) as pool:   # polled meanwhile: the request for machines is withdrawn during it
        pending = pool.submit(httpx.post, f"{head}/v2/models/{model}/infer", json=slow, timeout=busy_s + 60)
        def every() -> None:
            r.poll()
            if control:
                drop_holds(r)

        _poll_until("the busy request", pending.done, busy_s + 60, every)
        busy = pending.result()
    r.mark("busy_done")
    survived = bool(serving) and set(serving) <= set(cluster.alive_workers())
    _poll_until("back to zero workers", lambda: "zero" in r.events, timeout_s, r.poll)
    gone = [w.gone_at for w in cluster.workers.values() if w.seen_at >= r.accepted and w.gone_at is not None]
    if gone:   # when the launcher saw the worker's raylet gone (`zero` is polled only after the busy request)
        r.events["raylet_gone"] = round(min(gone) - r.accepted, 3)
    return {"events": r.events, "job": job, "busy_status": busy.status_code, "busy_outputs": busy.json(),
            "survived_busy": survived, "workers_launched": r.launched(), "control": control}


def inside(args: argparse.Namespace) -> dict[str, Any]:
    from ember.cluster.autoscaling import AutoscaledCluster, AutoscalerSettings
    from ember.testing.postgres import PostgresServer

    settings = AutoscalerSettings(max_workers=1, idle_timeout_s=args.idle_timeout_s, v2=args.v2)
    t0 = time.monotonic()
    seen: list[Round] = []
    with PostgresServer() as pg:
        common = ["--no-examples", "--sandbox", "off", "--jobs-url", pg.create_database("autoscale"),
                  "--request-timeout-s", "60", "--queue-wait-s", "1", "--models", args.model]
        with AutoscaledCluster(args.root, common, [*common, "--cpu-slots", "1"], settings) as cluster:
            _poll_until("the head's gateway", lambda: _ready(cluster.gateway_url), 120, lambda: None)
            started_s = time.monotonic() - t0
            name = Path(args.model).stem
            try:
                rounds = [run_round(cluster, name, args.busy_s, args.timeout_s, seen, args.control)
                          for _ in range(args.rounds)]
            except Exception as err:
                status = subprocess.run([str(Path(sys.executable).parent / "ray"), "status", "-v"],
                                        capture_output=True, text=True).stdout
                raise RuntimeError(f"{type(err).__name__}: {err}; events so far: {[r.events for r in seen]}; "
                                   f"ray status:\n{status[-2500:]}") from err
            done = time.monotonic()
    return {"close_s": round(time.monotonic() - done, 2),
            "settings": {"idle_timeout_s": settings.idle_timeout_s, "update_interval_s": settings.update_interval_s,
                         "worker_cpus": settings.worker_cpus, "busy_s": args.busy_s, "linger_s": 2.0,
                         "autoscaler": "v2" if settings.v2 else "v1"},
            "cluster_start_s": round(started_s, 2), "rounds": rounds}


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ember.testing.autoscale")
    p.add_argument("--model", required=True, help="a sleeper-like contract (input `seconds`)")
    p.add_argument("--root", type=Path, required=True, help="state directories")
    p.add_argument("--out", type=Path, required=True, help="the JSON written")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--idle-timeout-s", type=float, default=6.0)
    p.add_argument("--busy-s", type=float, default=10.0)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--v2", action="store_true", help="Ray's autoscaler v2 (default: v1)")
    p.add_argument("--control", action="store_true",
                   help="take the worker's bundle away during the busy request: what Ray does without the hold")
    p.add_argument("--inside", action="store_true", help="already in namespaces of its own")
    args = p.parse_args(argv)
    if not args.inside:
        from ember.cluster.autoscaling import namespaced

        cmd = namespaced([sys.executable, "-m", "ember.testing.autoscale", *(argv or sys.argv[1:]), "--inside"])
        return subprocess.run(cmd, env=os.environ.copy()).returncode
    try:
        result = inside(args)
    except Exception as err:
        result = {"error": f"{type(err).__name__}: {err}"}
    args.out.write_text(json.dumps(result, indent=2))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
