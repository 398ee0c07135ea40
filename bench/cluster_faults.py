"""bench/cluster.py's faults section: a link slowed, a node killed, a link cut, each under iris traffic through
node 2 with sleeper jobs queued (see bench/cluster.py's docstring). Measured per fault: when Ray's GCS marked the
node dead, when the controller dropped it (and why), when node 2's view lacked it; requests failed against those
in flight at the fault; the jobs the node held, lost, started twice, finished twice. The node cut (node 3) runs
supervised, as docs/cluster.md tells an operator (`ray start` and `ember serve` restarted when they exit): after
the heal, when it is back in node 2's view, as a new Ray node."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import ray

from ember.testing.netns_cluster import NetnsCluster, NetnsNode

BODY = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2]}]}
CLIENTS, JOBS, RUN_S = 4, 4, 8.0
TARGET_DETECT_S = 2.0
SLOW_RATE = "2mbit"
BACK_WAIT_S = 90.0   # after a cut node's link is healed: for it to be back in node 2's view (a new Ray node)


def sleeper_contract(root: Path, sleeper: Path) -> Path:
    """The tests' sleeper, writing a line as each request starts and ends to `root/runs.log`."""
    folder = root / "sleeper-model"
    folder.mkdir(exist_ok=True)
    (folder / "sleeper.yaml").write_text(sleeper.read_text() + f"options: {{log: '{root / 'runs.log'}'}}\n")
    if not (folder / "sleeper").exists():
        (folder / "sleeper").symlink_to(sleeper.parent / "sleeper")
    return folder / "sleeper.yaml"


def _status(node: NetnsNode) -> dict[str, Any]:
    status: dict[str, Any] = httpx.get(node.url + "/ember/status", timeout=5).json()["node"]["cluster"]
    return status


class Traffic:
    """CLIENTS clients sending iris through `via`, each request logged (start, end, status)."""

    def __init__(self, via: NetnsNode) -> None:
        self.via = via
        self.log: list[tuple[float, float, int]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client) for _ in range(CLIENTS)]

    def _client(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    reply = client.post(self.via.url + "/v2/models/iris/infer", json=BODY)
                    status = reply.status_code
                    if status not in (200, 202):
                        self.errors.append(reply.text[:300])
                except httpx.HTTPError as err:
                    status = 0
                    self.errors.append(repr(err))
                self.log.append((t0, time.monotonic(), status))

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


class Watch:
    """Polls, from the fault on, when Ray's GCS says `node` is dead and when `via`'s view lacks it."""

    def __init__(self, node: NetnsNode, via: NetnsNode) -> None:
        self.node, self.via = node, via
        self.gcs_dead: float | None = None
        self.view_gone: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set() and (self.gcs_dead is None or self.view_gone is None):
            if self.gcs_dead is None and any(n["NodeID"] == self.node.node_id and not n["Alive"]
                                             for n in ray.nodes()):
                self.gcs_dead = time.monotonic()
            if self.view_gone is None:
                try:
                    nodes = {n["node"] for n in _status(self.via)["nodes"]}
                except (httpx.HTTPError, ValueError, KeyError):
                    nodes = {self.node.node_id}
                if self.node.node_id not in nodes:
                    self.view_gone = time.monotonic()
            time.sleep(0.02)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def runs(root: Path) -> list[tuple[str, str, int]]:
    """sleeper's run log: (what, seconds, pid), warm-ups left out."""
    log = root / "runs.log"
    lines = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    return [(w, s, int(p)) for w, s, p in lines if float(s) != 0]


def submit_jobs(client: httpx.Client, node: NetnsNode, base: float) -> dict[str, str]:
    """JOBS sleeper jobs of about a second each, through `node`: seconds (each its own) -> the job's location."""
    out = {}
    for k in range(JOBS):
        seconds = base + k / 64
        reply = client.post(node.url + "/v2/models/sleeper/infer", headers={"Prefer": "respond-async"},
                            json={"inputs": [{"name": "seconds", "shape": [1], "datatype": "FP32", "data": [seconds]}]})
        if reply.status_code != 202:
            raise RuntimeError(f"job: {reply.status_code} {reply.text}")
        out[repr(float(np.float32(seconds)))] = reply.headers["location"]   # as sleeper logs it
    return out


def _jobs_outcome(root: Path, jobs: dict[str, str], via: NetnsNode, held: set[str]) -> dict[str, Any]:
    states: dict[str, str] = {}
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and len(states) < len(jobs):
        for seconds, loc in jobs.items():
            if seconds not in states:
                state = httpx.get(via.url + loc, timeout=10).json().get("status")
                if state in ("succeeded", "failed"):
                    states[seconds] = str(state)
        time.sleep(0.25)
    logged = runs(root)
    starts = {s: sum(1 for w, x, _ in logged if w == "start" and x == s) for s in jobs}
    ends = {s: sum(1 for w, x, _ in logged if w == "end" and x == s) for s in jobs}
    succeeded = sum(v == "succeeded" for v in states.values())
    return {"submitted": len(jobs), "held_by_the_node": len(held), "succeeded": succeeded,
            "failed": sum(v == "failed" for v in states.values()), "lost": len(jobs) - succeeded,
            "started_twice": sum(n > 1 for n in starts.values()), "finished_twice": sum(n > 1 for n in ends.values())}


def fault(cluster: NetnsCluster, root: Path, victim: NetnsNode, kind: str, base: float,
          carriers: list[NetnsNode]) -> dict[str, Any]:
    """Kill `victim` or cut its link under traffic through node 2 to iris warm on `carriers` (the victim one of
    them), sleeper jobs queued through the victim."""
    via = next(n for n in cluster.nodes if n.index == 2)
    lost0, retried0 = _status(via)["lost"], _status(via)["retried"]
    warm = {n["node"]: n["warm"] for n in _status(via)["nodes"]}
    with httpx.Client(timeout=30) as client:
        jobs = submit_jobs(client, victim, base)
    victim_pids = set(victim.ns.pids())
    deadline = time.monotonic() + 30   # until the victim runs one of them (or another node took them all)
    while time.monotonic() < deadline and not any(p in victim_pids for w, s, p in runs(root) if s in jobs):
        time.sleep(0.05)
        victim_pids = set(victim.ns.pids())
    with httpx.Client(timeout=30) as client:   # warm now: a paused instance is not routed to
        for node in carriers:
            client.post(node.url + "/v2/models/iris/infer", json=BODY)
    time.sleep(0.6)   # node 2's view has them warm
    with Traffic(via) as traffic, Watch(victim, via) as watch:
        time.sleep(1.0)
        logged = runs(root)
        held = {s for w, s, p in logged if w == "start" and s in jobs and p in victim_pids
                and not any(w2 == "end" and s2 == s for w2, s2, _ in logged)}
        at = time.monotonic()
        if kind == "kill":
            cluster.kill(victim)
            assert victim.ns.killed_at is not None
            at = victim.ns.killed_at   # the first process stopped (after listing them: a few ms)
        else:
            victim.ns.cut()
        time.sleep(RUN_S)
    departed = [(cause, when) for node, cause, when in cluster.departed() if node == victim.node_id]
    if kind == "cut":
        victim.ns.heal()
        back = _back(cluster, victim, via, BACK_WAIT_S)
    log = traffic.log
    failed = [(s, e, st) for s, e, st in log if st not in (200, 202) and e >= at]
    out: dict[str, Any] = {
        "kind": kind, "node": victim.index,
        "gcs_dead_s": None if watch.gcs_dead is None else watch.gcs_dead - at,
        "controller_dropped_s": departed[0][1] - at if departed else None,
        "controller_cause": departed[0][0] if departed else None,
        "view_of_node2_s": None if watch.view_gone is None else watch.view_gone - at,
        "in_flight_at_fault": sum(1 for s, e, _ in log if s <= at < e),
        "requests_after_fault": sum(1 for s, e, _ in log if e >= at),
        "failed": len(failed), "failed_statuses": sorted({st for *_, st in failed}),
        "failed_started_after_fault": sum(1 for s, _, _ in failed if s > at),
        "node2_lost": _status(via)["lost"] - lost0, "node2_retried": _status(via)["retried"] - retried0,
        "errors": traffic.errors[:4], "jobs": _jobs_outcome(root, jobs, via, held),
        "warm_instances_before": {str(n.index): warm.get(n.node_id, 0) for n in [*cluster.nodes, *cluster.lost]}}
    if kind == "cut":
        out["back_after_heal"] = back
    detected = [v for v in (out["controller_dropped_s"], out["view_of_node2_s"]) if v is not None]
    out["detected_s"] = max(detected) if len(detected) == 2 else None
    return out


def _back(cluster: NetnsCluster, victim: NetnsNode, via: NetnsNode, timeout_s: float) -> dict[str, Any]:
    """After the heal: when the victim's gateway is back in `via`'s view (its supervisor restarted `ray start` and
    `ember serve`: a new Ray node at its address), seconds from the heal; whether its old Ray node id came back."""
    healed = time.monotonic()
    out: dict[str, Any] = {"in_view_s": None, "new_ray_node": None, "old_id_in_view": False}
    while time.monotonic() - healed < timeout_s:
        try:
            nodes = {n["node"]: n["url"] for n in _status(via)["nodes"]}
        except (httpx.HTTPError, ValueError, KeyError):
            nodes = {}
        out["old_id_in_view"] = out["old_id_in_view"] or victim.node_id in nodes
        back = [node for node, url in nodes.items() if url == victim.url and node != victim.node_id]
        if back:
            out.update(in_view_s=time.monotonic() - healed, new_ray_node=back[0] == cluster.new_ray_node(victim))
            break
        time.sleep(0.25)
    return out


def slow(cluster: NetnsCluster, victim: NetnsNode) -> dict[str, Any]:
    """The victim's link at SLOW_RATE both ways (tbf) under traffic through node 2: latency, failures, and whether
    anything took it for dead."""
    via = next(n for n in cluster.nodes if n.index == 2)

    def measure() -> dict[str, Any]:
        with Traffic(via) as traffic:
            time.sleep(RUN_S / 2)
        took = sorted(e - s for s, e, _ in traffic.log)
        return {"n": len(took), "p50_ms": statistics.median(took) * 1000,
                "p99_ms": took[min(len(took) - 1, int(0.99 * len(took)))] * 1000,
                "failed": sum(1 for *_, st in traffic.log if st != 200)}

    before = measure()
    victim.ns.slow(SLOW_RATE)
    try:
        with Watch(victim, via) as watch:
            during = measure()
    finally:
        victim.ns.unslow()
    return {"rate": SLOW_RATE, "node": victim.index, "before": before, "slowed": during,
            "taken_for_dead": watch.gcs_dead is not None or watch.view_gone is not None}


def _iris(node: NetnsNode, load: bool) -> None:
    """Deploy iris on `node` afresh (a template, no instance) or take it off (its instances and template)."""
    with httpx.Client(timeout=60) as client:
        reply = client.post(node.url + f"/v2/repository/models/iris/{'load' if load else 'unload'}")
        if reply.status_code != 200:
            raise RuntimeError(f"iris {'load' if load else 'unload'} on node {node.index}: {reply.text}")


def faults(cluster: NetnsCluster, root: Path, extra_node: list[str]) -> dict[str, Any]:
    """Node 3 joins (iris and sleeper), then: node 0's link slowed, node 1 killed, node 3's link cut. Node 2 routes
    to warm instances only, and among equally idle ones always to the same (the view's loads are 0.5 s old): the
    node lost is made the one carrying the traffic (iris warm there alone), another node holding iris's template
    to start from. Slowed: iris on node 0 alone; killed: warm on node 1, a template on node 3 (node 0's taken
    off); cut: warm on node 3, a template on node 0."""
    cluster.add_node(extra_node, supervise=True)   # the node cut, then healed: its supervisor brings it back
    by_index = {n.index: n for n in cluster.nodes}
    with httpx.Client(timeout=60) as client:   # sleeper on 1 and 3, warm
        for i in (1, 3):
            client.post(by_index[i].url + "/v2/models/sleeper/infer",
                        json={"inputs": [{"name": "seconds", "shape": [1], "datatype": "FP32", "data": [0.0]}]})
    for i in (1, 3):
        _iris(by_index[i], load=False)
    time.sleep(1.0)
    out: dict[str, Any] = {"slow": slow(cluster, by_index[0])}
    _iris(by_index[0], load=False)
    for i in (1, 3):
        _iris(by_index[i], load=True)
    time.sleep(1.0)
    out["kill"] = fault(cluster, root, by_index[1], "kill", 1.0, [by_index[1]])
    for i in (0, 3):
        _iris(by_index[i], load=True)
    time.sleep(1.0)
    out["cut"] = fault(cluster, root, by_index[3], "cut", 1.5, [by_index[3]])
    return out


def rows(f: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The faults' rows of the report: (row, measured, target, met)."""
    out = []
    sl = f["slow"]
    out.append((f"node {sl['node']}'s link slowed to {sl['rate']} (tbf): iris through node 2, p50 / p99",
                f"{sl['before']['p50_ms']:.2f} / {sl['before']['p99_ms']:.2f} ms before, {sl['slowed']['p50_ms']:.2f} "
                f"/ {sl['slowed']['p99_ms']:.2f} ms slowed; failed {sl['slowed']['failed']} of {sl['slowed']['n']}; "
                f"taken for dead: {sl['taken_for_dead']}", "0 failed", str(sl["slowed"]["failed"] == 0)))
    for key in ("kill", "cut"):
        r, j = f[key], f[key]["jobs"]
        what = "killed" if key == "kill" else "link cut"
        gcs = "-" if r["gcs_dead_s"] is None else f"{r['gcs_dead_s']:.2f} s"
        ctl = ("-" if r["controller_dropped_s"] is None
               else f"{r['controller_dropped_s']:.2f} s ({r['controller_cause']})")
        view = "-" if r["view_of_node2_s"] is None else f"{r['view_of_node2_s']:.2f} s"
        det = r["detected_s"]
        out.append((f"node {r['node']} {what}: detected (Ray's GCS / controller / node 2's view)",
                    f"{gcs} / {ctl} / {view}", f"<= {TARGET_DETECT_S:g} s",
                    str(det is not None and det <= TARGET_DETECT_S)))
        out.append((f"  requests failed of {r['requests_after_fault']} after the fault (in flight at it: "
                    f"{r['in_flight_at_fault']})",
                    f"{r['failed']} {r['failed_statuses']} ({r['failed_started_after_fault']} sent after the fault; "
                    f"node 2: {r['node2_lost']} lost, {r['node2_retried']} sent elsewhere)",
                    "<= in flight", str(r["failed"] <= r["in_flight_at_fault"])))
        extra = ""
        if key == "cut":
            b = r["back_after_heal"]
            extra = (f"; back in node 2's view {b['in_view_s']:.1f} s after the heal, as a new Ray node: "
                     f"{b['new_ray_node']}" if b["in_view_s"] is not None
                     else f"; not back in node 2's view {BACK_WAIT_S:g} s after the heal")
        out.append((f"  jobs ({j['submitted']} queued, {j['held_by_the_node']} running on it at the fault)",
                    f"{j['succeeded']} succeeded, {j['lost']} lost, {j['started_twice']} started twice, "
                    f"{j['finished_twice']} finished twice{extra}", "0 lost", str(j["lost"] == 0)))
    return out
