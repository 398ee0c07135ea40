"""ember on a Ray cluster of this machine (issue 14): what going across nodes costs, measured end to end.

Three Ray nodes (`ember.cluster.local.LocalCluster`: a head with no CPUs and the controller actor, three
nodes with one CPU each, each with its node agent and `ember serve --ray`): nodes 0 and 1 serve iris (the
bundled example) and sleeper-free traffic, node 2 serves nothing and forwards. One PostgreSQL job store
(`ember.testing.postgres`). Rows, one run:

- placement decision: the controller's `place` as a gateway pays it (a Ray actor call) and as computed in
  the controller (`ClusterState.place`: the view's snapshot built, then the vectorised decision); the
  decision alone at 100 nodes is bench/placement.py's;
- hot request through another node's gateway (node 2, forwarded over HTTP to a warm instance on node 0 or
  1) vs a local hot request (node 0); target: p50 overhead ≤ 2 ms;
- first request for a model on a node that holds its template (a fresh deploy: template, no instance),
  asked through node 2's gateway, vs the same on a single-node `ember serve` running beside the cluster and
  holding what node 0 holds (the same models and slots, with its own store and SQLite jobs);
  target: within 1.2×; and vs the same asked at node 0 itself (the cluster's own node, no hop). The three sides
  take turns, each after the same idle time, so that every side sees the same machine (a block of one side
  then a block of another measured the machine's load as much as the cluster);
- recovery: node 1 removed (`remove_node`) under traffic through node 2; the time until every request
  succeeds again (target ≤ 5 s), and the jobs node 1 had claimed, run elsewhere (target: zero lost);
- hot streams (the tests' wordy model, no delay between its words, on node 0): time to the first word and to
  the end of a 10-word streamed chat completion asked at node 0 and through node 2, interleaved (no target: what
  a stream pays for the hop);
- peer vs origin: the first request for a store-backed model (MiniLM, `weights: store:minilm:1`, no template) on
  a node with no weights: node 1 pulls the chunks from the origin (nginx throttled to 100 MiB/s in all: 25m per
  connection, the store's four), then node 2 from a peer (node 1, found through the controller). Each start is
  placed on its node directly (`POST /cluster/infer`, as a gateway forwards one). The headline follows
  bench/peer_fetch.py's rule: the fetch from the peer against the origin at its best, the floor bytes / 100 MiB/s
  (the measured origin fetch is slower: one 47 MB chunk comes over one connection at 25 MiB/s); target ≥ 3×.

Prints a table and writes bench/results/cluster.json (bench/results/cluster-SECTIONS.json with --sections).
Usage: python bench/cluster.py [--hot 300 --firsts 5] [--sections peer,...]; sections: placement, hot, first,
peer, recovery (recovery removes node 1, so it runs last).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import ray
from rich.console import Console
from rich.table import Table

from ember.clock import SystemClock
from ember.cluster.local import LocalCluster, LocalNode
from ember.cluster.state import ClusterState
from ember.store import StoreConfig, WeightStore
from ember.testing import postgres
from ember.testing.models import minilm_dir, store_backed_minilm
from ember.testing.nginx import NginxOrigin
from ember.testing.server import EmberServer, wait_for
from ember.wire.cluster import pack_tensors
from ember.wire.contract import example_contracts_dir

IRIS = str(example_contracts_dir() / "iris.yaml")
BODY = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2]}]}
# Streams run while node 0 has a free slot (wordy starts there, not on a node with one), then drop their instance.
SECTIONS = ("placement", "hot", "streams", "first", "peer", "recovery")
KEYS = {"peer": "peer_vs_origin"}   # a section's key in the JSON where it differs
TARGET_OVERHEAD_MS, TARGET_FIRST_RATIO, TARGET_RECOVERY_S, TARGET_PEER = 2.0, 1.2, 5.0, 3.0
ORIGIN_MIB_S, STORE_THREADS = 100, 4    # the origin's total rate; the store's connections (its default threads)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def stats_ms(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {"n": len(ms), "p50_ms": statistics.median(ms), "p99_ms": pct(ms, 0.99), "mean_ms": statistics.fmean(ms)}


def timed_requests(client: httpx.Client, url: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        reply = client.post(url + "/v2/models/iris/infer", json=BODY)
        out.append(time.perf_counter() - t0)
        if reply.status_code != 200:
            raise RuntimeError(f"{url}: {reply.status_code} {reply.text}")
    return out


def placement(cluster: LocalCluster, n: int) -> dict[str, Any]:
    controller = cluster.controller()
    ray.get(controller.place.remote("iris:1"))
    trips = []
    for _ in range(n):
        t0 = time.perf_counter()
        ray.get(controller.place.remote("iris:1"))
        trips.append(time.perf_counter() - t0)
    view = ray.get(controller.view.remote())
    state = ClusterState(SystemClock(), ttl_s=0.0, token=view.token)
    computes = []
    for _ in range(n):
        for inv in view.nodes:
            state.report(inv)
        t0 = time.perf_counter()
        state.place("iris:1")
        computes.append(time.perf_counter() - t0)
    # Each place() counts as a start queued on its node until that node reports again: let every node report,
    # so the rows below do not see the decisions measured here as queued starts.
    time.sleep(2)
    return {"actor_call": stats_ms(trips), "in_controller": stats_ms(computes), "nodes": len(view.nodes)}


def _cluster(node: LocalNode) -> dict[str, Any]:
    status: dict[str, Any] = httpx.get(node.url + "/ember/status", timeout=5).json()["node"]["cluster"]
    return status


def forwarded(node: LocalNode) -> int:
    return int(_cluster(node)["forwarded"])


def deployed_here(node: LocalNode, model: str = "iris") -> bool:
    """Whether `model` is deployed on the node (node 2 serves minilm-store too, once the peer row has run)."""
    return any(m["name"] == model for m in httpx.get(node.url + "/ember/status", timeout=5).json()["models"])


def hot(cluster: LocalCluster, n: int) -> dict[str, Any]:
    n0, n1, n2 = cluster.nodes
    with httpx.Client(timeout=30) as client:
        timed_requests(client, n0.url, 20)
        timed_requests(client, n1.url, 20)
        time.sleep(1.0)   # node 2's view has them warm
        timed_requests(client, n2.url, 20)
        before = forwarded(n2)
        local, remote = [], []
        for _ in range(n // 10):   # interleaved, so both see the same machine
            local += timed_requests(client, n0.url, 10)
            remote += timed_requests(client, n2.url, 10)
    result: dict[str, Any] = {"local": stats_ms(local), "through_another_node": stats_ms(remote),
                              "forwarded_by_node2": forwarded(n2) - before, "node2_serves_iris": deployed_here(n2)}
    result["overhead_p50_ms"] = result["through_another_node"]["p50_ms"] - result["local"]["p50_ms"]
    return result


IDLE_BEFORE_FIRST_S = 1.5   # every side idles as long before its first request (node 2's view sees the deploy)


def _redeploy(client: httpx.Client, url: str, model: str = "iris") -> None:
    """Re-deploy `model` on `url`: its template stays, its instances go."""
    assert client.post(url + f"/v2/repository/models/{model}/load").status_code == 200
    wait_for(lambda: client.get(url + "/v2/health/ready").status_code == 200, 60)
    wait_for(lambda: not any(m["instances"] for m in client.get(url + "/ember/status").json()["models"]
                             if m["name"] == model), 60)


def _first(client: httpx.Client, load_on: tuple[str, ...], ask: str) -> float:
    """Re-deploy iris on every URL of `load_on` (a template each, no instance), idle, then time the first request
    through `ask`."""
    for url in load_on:
        _redeploy(client, url)
    time.sleep(IDLE_BEFORE_FIRST_S)
    t0 = time.perf_counter()
    reply = client.post(ask + "/v2/models/iris/infer", json=BODY)
    took = time.perf_counter() - t0
    if reply.status_code != 200:
        raise RuntimeError(f"first request: {reply.status_code} {reply.text}")
    return took


def first_requests(cluster: LocalCluster, root: Path, k: int, single_args: list[str]) -> dict[str, Any]:
    """The three sides interleaved, each after the same idle time, so that all see the same machine: node 2
    places the start on a template node (on its own fresh view, telling the controller after) and forwards it
    there; the same asked at node 0 itself; a single-node `ember serve` beside the cluster, holding what node 0
    holds (`single_args`)."""
    n0, n1, n2 = cluster.nodes
    clustered, same_node, alone = [], [], []
    with httpx.Client(timeout=60) as client, EmberServer(root / "single", *single_args) as single:
        _first(client, (single.url,), single.url)   # each side's first-ever start is not what is measured
        _first(client, (n0.url, n1.url), n0.url)
        for _ in range(k):
            clustered.append(_first(client, (n0.url, n1.url), n2.url))
            same_node.append(_first(client, (n0.url, n1.url), n0.url))
            alone.append(_first(client, (single.url,), single.url))
    result: dict[str, Any] = {"cluster_template_node": stats_ms(clustered), "single_node": stats_ms(alone),
                              "cluster_same_node": stats_ms(same_node), "node2_serves_iris": deployed_here(n2),
                              "idle_before_s": IDLE_BEFORE_FIRST_S}
    result["ratio_p50"] = result["cluster_template_node"]["p50_ms"] / result["single_node"]["p50_ms"]
    result["ratio_same_node_p50"] = result["cluster_template_node"]["p50_ms"] / result["cluster_same_node"]["p50_ms"]
    return result


WORDY = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "models" / "wordy.yaml"


def wordy_contract(root: Path) -> Path:
    """The tests' streaming model (one word per reply, a text-generation request and reply), without its delay
    between words: what is measured is the hop, not the model."""
    folder = root / "wordy-model"
    folder.mkdir(exist_ok=True)
    (folder / "wordy.yaml").write_text(WORDY.read_text().replace("options: {delay_s: 0.05}", "options: {delay_s: 0}"))
    if not (folder / "wordy").exists():
        (folder / "wordy").symlink_to(WORDY.parent / "wordy")
    return folder / "wordy.yaml"


def _stream(client: httpx.Client, url: str, words: int) -> tuple[float, float]:
    """Time to the first word and to the end of one streamed chat completion (SSE) of `words` words."""
    body = {"model": "wordy", "stream": True, "messages": [{"role": "user", "content": " ".join(["w"] * words)}]}
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", url + "/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"stream: {reply.status_code} {reply.read()!r}")
        for line in reply.iter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter() - t0
    return first if first is not None else float("nan"), time.perf_counter() - t0


def streams(cluster: LocalCluster, n: int, words: int = 10) -> dict[str, Any]:
    """A hot stream of wordy (node 0's) asked at node 0 and through node 2, interleaved: TTFT and the whole.
    Where each side was served is counted (node 0 forwards none, node 2 all when wordy runs on node 0 alone);
    wordy's instance is dropped after, so that the first-request rows find node 0 as before."""
    n0, n2 = cluster.nodes[0], cluster.nodes[-1]
    with httpx.Client(timeout=30) as client:
        for _ in range(5):
            _stream(client, n0.url, words)
        time.sleep(1.0)   # node 2's view has wordy warm on node 0
        before = forwarded(n0), forwarded(n2)
        local, remote = [], []
        for _ in range(n):
            local.append(_stream(client, n0.url, words))
            remote.append(_stream(client, n2.url, words))
        _redeploy(client, n0.url, "wordy")
    out: dict[str, Any] = {"words": words, "forwarded_by_node0": forwarded(n0) - before[0],
                           "forwarded_by_node2": forwarded(n2) - before[1], "node2_serves_wordy": deployed_here(n2,
                                                                                                               "wordy")}
    for name, rows in (("local", local), ("through_another_node", remote)):
        out[name] = {"ttft": stats_ms([r[0] for r in rows]), "total": stats_ms([r[1] for r in rows])}
    out["ttft_overhead_p50_ms"] = out["through_another_node"]["ttft"]["p50_ms"] - out["local"]["ttft"]["p50_ms"]
    return out


def recovery(cluster: LocalCluster) -> dict[str, Any]:
    _, n1, n2 = cluster.nodes
    with httpx.Client(timeout=30) as client:
        jobs = [client.post(n1.url + "/v2/models/iris/infer", json=BODY, headers={"Prefer": "respond-async"})
                for _ in range(5)]
    locations = [j.headers["location"] for j in jobs if j.status_code == 202]
    log: list[tuple[float, float, int]] = []
    stop = threading.Event()

    def traffic() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    status = c.post(n2.url + "/v2/models/iris/infer", json=BODY).status_code
                except httpx.HTTPError:
                    status = 0
                log.append((t0, time.monotonic(), status))

    threads = [threading.Thread(target=traffic) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(2)
    retried_before = _cluster(n2)["retried"]
    own = deployed_here(n2)   # the cluster may have placed a start on node 2 too: then it needs node 1 less
    removed = time.monotonic()
    cluster.remove_node(n1)
    time.sleep(10)
    stop.set()
    for t in threads:
        t.join(60)
    failed = [(s, e, st) for s, e, st in log if st != 200 and e >= removed]
    recovered_s = max((e for _, e, _ in failed), default=removed) - removed
    n0 = cluster.nodes[0]
    deadline, done = time.monotonic() + 60, 0
    while time.monotonic() < deadline:
        done = sum(httpx.get(n0.url + loc).json().get("status") == "succeeded" for loc in locations)
        if done == len(locations):
            break
        time.sleep(0.5)
    return {"recovery_s": recovered_s, "requests_after_removal": sum(1 for s, _, _ in log if s >= removed),
            "failed_after_removal": len(failed), "failed_statuses": sorted({st for _, _, st in failed}),
            "jobs_on_removed_node": len(locations), "jobs_succeeded": done,
            "jobs_lost": len(locations) - done, "retried_elsewhere": _cluster(n2)["retried"] - retried_before,
            "node2_serves_iris_at_removal": own}


def store_model(root: Path) -> tuple[Path, Path, int]:
    """MiniLM pushed to an origin root, and a models dir with its store-backed contract (no template)."""
    origin = root / "origin"
    with WeightStore(StoreConfig(root=origin, memory_dir=None, fsync=False)) as publisher:
        manifest = publisher.push(minilm_dir(), "minilm:1")
    models = store_backed_minilm(root / "store-models", "minilm-store").parent
    return origin, models, sum(c.size for c in manifest.unique_chunks().values())


def _metric(node: LocalNode, prefix: str) -> float:
    for line in httpx.get(node.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _first_on(node: LocalNode, token: str) -> float:
    body = pack_tensors({"text": np.array([b"weights from a peer", b"or the origin"], dtype=object)})
    t0 = time.perf_counter()
    reply = httpx.post(node.url + "/cluster/infer/minilm-store/1", content=body,
                       headers={"x-ember-cluster-token": token}, timeout=120)
    took = time.perf_counter() - t0
    if reply.status_code != 200:
        raise RuntimeError(f"first request on {node.url}: {reply.status_code} {reply.text}")
    return took


def _reported(cluster: LocalCluster, node: LocalNode) -> dict[str, float]:
    """The bandwidths the node reports to the controller once its store measured the fetch (and, a little later,
    the memory-tier fill's disk reads); disk and net are the assumed figures where it has measured none."""
    time.sleep(2.0)   # the fill behind the start, then a report (every 0.5 s)
    inv = next(n for n in ray.get(cluster.controller().view.remote()).nodes if n.node == node.node_id)
    found = {"disk": inv.disk_bps, "net": inv.net_bps}
    return found if inv.origin_bps is None else {**found, "origin": inv.origin_bps}


def peer_vs_origin(cluster: LocalCluster, size: int) -> dict[str, Any]:
    """The first request for the store-backed model on node 1 (origin), then on node 2 (peer: node 1)."""
    _, n1, n2 = cluster.nodes
    token = ray.get(cluster.controller().token.remote())
    fetch = 'ember_cold_start_phase_seconds_sum{model="minilm-store",phase="fetch"'
    out: dict[str, Any] = {"bytes": size, "origin_mib_s": ORIGIN_MIB_S, "connections": STORE_THREADS}
    # Run alone (--sections peer) the nodes may not have the registry yet: the controller's, then a report round.
    wait_for(lambda: any(c.key == "minilm-store:1" for c in ray.get(cluster.controller().view.remote()).contracts), 30)
    time.sleep(1.5)
    for source, node in (("origin", n1), ("peer", n2)):
        total = _first_on(node, token)
        fetched = wait_for(lambda n=node: _metric(n, fetch), 10)
        by_source = wait_for(lambda n=node: (b := {s: _metric(n, f'ember_store_fetched_bytes_total{{source="{s}"}}')
                                                   for s in ("peer", "origin")}) and sum(b.values()) and b, 10)
        out[source] = {"first_request_s": total, "fetch_s": fetched, "fetched_bytes": by_source,
                       "reported_bps": _reported(cluster, node)}
        if source == "origin":   # node 2 asks once the controller lists node 1 as holding every chunk
            wait_for(lambda: any(h.node == n1.node_id
                                 for h in ray.get(cluster.controller().holders.remote("minilm-store:1"))), 10)
    floor = size / (ORIGIN_MIB_S * 2**20)
    peer, origin = out["peer"], out["origin"]
    out["origin_floor_s"] = floor
    out["fetch_ratio_vs_floor"] = floor / peer["fetch_s"]
    out["fetch_ratio_measured"] = origin["fetch_s"] / peer["fetch_s"]
    # The first request had the origin fetched at its floor: the rest of the peer's first request, plus the floor.
    out["first_ratio_vs_floor"] = (peer["first_request_s"] - peer["fetch_s"] + floor) / peer["first_request_s"]
    out["first_ratio_measured"] = origin["first_request_s"] / peer["first_request_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hot", type=int, default=300, help="hot requests per side")
    parser.add_argument("--firsts", type=int, default=12, help="first requests per side")
    parser.add_argument("--place", type=int, default=300, help="placement decisions")
    parser.add_argument("--streams", type=int, default=50, help="hot streams per side")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated rows to measure, of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/cluster.json, or "
                                                               "cluster-SECTIONS.json for some sections")
    args = parser.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        parser.error(f"--sections: {', '.join(unknown) or 'none given'}: choose from {', '.join(SECTIONS)}")
    if args.out is None:
        some = "" if set(sections) == set(SECTIONS) else "-" + "-".join(s for s in SECTIONS if s in sections)
        args.out = Path(__file__).parent / "results" / f"cluster{some}.json"
    root = Path(tempfile.mkdtemp(prefix="ember-bench-cluster-"))
    origin_root, store_models, size = store_model(root)
    per_connection = f"{ORIGIN_MIB_S // STORE_THREADS}m"
    with postgres.PostgresServer() as pg, NginxOrigin(origin_root, slow_rate=per_connection) as origin:
        common = ["--no-examples", "--sandbox", "off", "--jobs-url", pg.create_database("jobs"),
                  "--request-timeout-s", "10", "--queue-wait-s", "5", "--store-origin", origin.slow_url]
        nodes = [[*common, "--models", IRIS, "--models", str(store_models), "--models", str(wordy_contract(root)),
                  "--cpu-slots", "2"],
                 [*common, "--models", IRIS, "--cpu-slots", "2"], [*common, "--cpu-slots", "1"]]
        # The single node holds what node 0 holds (the same models, slots and flags, its own store), with the
        # single-node job store (SQLite): the difference is what being in the cluster costs.
        single = [a for a in nodes[0] if not a.startswith("postgresql://") and a != "--jobs-url"]
        single += ["--store-root", str(root / "store-single")]
        for i, node_args in enumerate(nodes):
            node_args += ["--store-root", str(root / f"store{i}")]
        rows: dict[str, Callable[[LocalCluster], Any]] = {
            "placement": lambda c: placement(c, args.place), "hot": lambda c: hot(c, args.hot),
            "first": lambda c: first_requests(c, root, args.firsts, single), "peer": lambda c: peer_vs_origin(c, size),
            "recovery": recovery, "streams": lambda c: streams(c, args.streams)}
        result: dict[str, Any] = {}
        with LocalCluster(root, nodes) as cluster:
            for name in SECTIONS:   # in this order whatever was asked: recovery removes a node
                if name in sections:
                    result[KEYS.get(name, name)] = rows[name](cluster)
    result["machine"] = {"python": platform.python_version(), "ray": ray.__version__, "cpu": platform.processor()}
    report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


def report(r: dict[str, Any]) -> None:
    table = Table(title="ember on a Ray cluster of this machine (3 nodes, one run)")
    for col in ("row", "measured", "target", "met"):
        table.add_column(col)
    for key, rows in (("placement", _placement_rows), ("hot", _hot_rows), ("first", _first_rows),
                      ("recovery", _recovery_rows), ("peer_vs_origin", _peer_rows), ("streams", _stream_rows)):
        if key in r:
            rows(table, r[key])
    Console().print(table)


def _placement_rows(table: Table, p: dict[str, Any]) -> None:
    table.add_row("place: controller actor call (gateway's cost)",
                  f"p50 {p['actor_call']['p50_ms']:.2f} ms, p99 {p['actor_call']['p99_ms']:.2f} ms", "-", "-")
    table.add_row(f"place: in the controller ({p['nodes']} nodes)",
                  f"p50 {p['in_controller']['p50_ms'] * 1000:.0f} µs, p99 {p['in_controller']['p99_ms'] * 1000:.0f} µs",
                  "-", "-")


def _hot_rows(table: Table, h: dict[str, Any]) -> None:
    table.add_row("hot request, local (node 0)",
                  f"p50 {h['local']['p50_ms']:.2f} ms, p99 {h['local']['p99_ms']:.2f} ms", "-", "-")
    table.add_row(f"hot request, through node 2 ({h['forwarded_by_node2']} forwarded; iris deployed on node 2: "
                  f"{h['node2_serves_iris']})", f"p50 {h['through_another_node']['p50_ms']:.2f} ms, "
                  f"p99 {h['through_another_node']['p99_ms']:.2f} ms", "-", "-")
    table.add_row("  overhead, p50", f"{h['overhead_p50_ms']:.2f} ms", f"≤ {TARGET_OVERHEAD_MS:g} ms",
                  str(h["overhead_p50_ms"] <= TARGET_OVERHEAD_MS))


def _first_rows(table: Table, f: dict[str, Any]) -> None:
    table.add_row("first request, template node via node 2", f"p50 {f['cluster_template_node']['p50_ms']:.0f} ms", "-",
                  "-")
    table.add_row("first request, single-node ember serve", f"p50 {f['single_node']['p50_ms']:.0f} ms", "-", "-")
    table.add_row("first request, asked at node 0 itself (same cluster, no hop)",
                  f"p50 {f['cluster_same_node']['p50_ms']:.0f} ms (via node 2: {f['ratio_same_node_p50']:.2f}×)",
                  "-", "-")
    table.add_row("  ratio, p50", f"{f['ratio_p50']:.2f}×", f"≤ {TARGET_FIRST_RATIO:g}×",
                  str(f["ratio_p50"] <= TARGET_FIRST_RATIO))


def _recovery_rows(table: Table, rec: dict[str, Any]) -> None:
    table.add_row("recovery after remove_node", f"{rec['recovery_s']:.2f} s ({rec['failed_after_removal']} of "
                  f"{rec['requests_after_removal']} requests failed: {rec['failed_statuses']}; "
                  f"{rec['retried_elsewhere']} retried elsewhere; iris on node 2 too: "
                  f"{rec['node2_serves_iris_at_removal']})",
                  f"≤ {TARGET_RECOVERY_S:g} s", str(rec["recovery_s"] <= TARGET_RECOVERY_S))
    table.add_row("  jobs of the removed node", f"{rec['jobs_succeeded']}/{rec['jobs_on_removed_node']} succeeded "
                  "elsewhere", "0 lost", str(rec["jobs_lost"] == 0))


def _peer_rows(table: Table, pv: dict[str, Any]) -> None:
    mb = pv["bytes"] / 1e6
    table.add_row(f"first request, no weights on the node: from the origin ({mb:.1f} MB, {ORIGIN_MIB_S} MiB/s over "
                  f"{pv['connections']} connections; node 1)",
                  f"{pv['origin']['first_request_s']:.2f} s (fetch {pv['origin']['fetch_s']:.2f} s)", "-", "-")
    table.add_row("first request, no weights on the node: from a peer (node 2, from node 1)",
                  f"{pv['peer']['first_request_s']:.2f} s (fetch {pv['peer']['fetch_s']:.2f} s; "
                  f"{pv['peer']['fetched_bytes']['peer'] / 1e6:.1f} MB from the peer, "
                  f"{pv['peer']['fetched_bytes']['origin'] / 1e6:.1f} MB from the origin)", "-", "-")
    table.add_row(f"  fetch: peer vs the origin at its floor ({pv['origin_floor_s']:.2f} s)",
                  f"{pv['fetch_ratio_vs_floor']:.2f}× (measured origin: {pv['fetch_ratio_measured']:.2f}×)",
                  f"≥ {TARGET_PEER:g}×", str(pv["fetch_ratio_vs_floor"] >= TARGET_PEER))
    table.add_row("  whole first request: peer vs origin at its floor",
                  f"{pv['first_ratio_vs_floor']:.2f}× (measured origin: {pv['first_ratio_measured']:.2f}×)", "-", "-")
    for source in ("origin", "peer"):
        bw = pv[source].get("reported_bps", {})
        table.add_row(f"  bandwidths node {1 if source == 'origin' else 2} reports after it (MB/s)",
                      ", ".join(f"{k} {v / 1e6:.0f}" for k, v in bw.items()) or "-", "-", "-")


def _stream_rows(table: Table, st: dict[str, Any]) -> None:
    table.add_row(f"hot stream ({st['words']} words, wordy on node 0), asked at node 0 ({st['forwarded_by_node0']} "
                  "forwarded)",
                  f"TTFT p50 {st['local']['ttft']['p50_ms']:.2f} ms, whole p50 {st['local']['total']['p50_ms']:.2f} ms",
                  "-", "-")
    table.add_row(f"hot stream through node 2 ({st['forwarded_by_node2']} forwarded; wordy deployed on node 2: "
                  f"{st['node2_serves_wordy']})",
                  f"TTFT p50 {st['through_another_node']['ttft']['p50_ms']:.2f} ms, whole p50 "
                  f"{st['through_another_node']['total']['p50_ms']:.2f} ms (TTFT +{st['ttft_overhead_p50_ms']:.2f} ms)",
                  "-", "-")


if __name__ == "__main__":
    main()
