"""ember on a Ray cluster of machines in network namespaces (issues 14 and 32): what going across nodes costs, and
what a node lost costs, measured end to end.

Every node is a machine of its own (`ember.testing.netns_cluster.NetnsCluster`): a network namespace with its own
IP and loopback, joined to the others by a veth pair and a bridge; inside it, `ray start --block` (its raylet,
node IP = the namespace's) and `ember serve --ray HEAD --host IP --port 8000`. The head (no CPUs: the controller
actor), the PostgreSQL job store and the nginx origin are on the host, at the bridge's address. Ray's GCS health
checks as docs/cluster.md recommends (`HEALTH_CHECK`: a node declared dead 1.1-1.2 s after it fell silent). Node 0
serves iris, `minilm-store` and `wordy`; node 1 iris and sleeper; node 2 nothing (it forwards); node 3 (added
for the faults) iris and sleeper. Links are plain HTTP with keys off (the lab's network is private); mutual TLS
is measured nowhere here. Rows, one run:

- placement decision: the controller's `place` as a gateway pays it (a Ray actor call) and as computed in
  the controller; the decision alone at 100 nodes is bench/placement.py's;
- hot request through another node's gateway (node 2, forwarded over the bridge to a warm instance on node 0 or
  1) vs a local hot request (node 0), both from a client on the host; target: p50 overhead <= 1 ms;
- hot streams (wordy on node 0): time to the first word, at node 0 and through node 2 (no target);
- first request for a model on a node that holds its template, asked through node 2, vs the same on a lone
  `ember serve` in a namespace of its own holding what node 0 holds, and at node 0 itself; the sides take turns
  after the same idle time; target: within 1.2x the lone server;
- peer vs origin: MiniLM's chunks (91.6 MB) pulled by node 1 from the origin (nginx, 100 MiB/s in all: 25m per
  connection, the store's four), then by node 2 from node 1 across namespaces; target: the peer fetch >= 3x the
  origin at its floor (bytes / 100 MiB/s);
- faults, under iris traffic through node 2 (4 clients) with sleeper jobs queued: node 0's link slowed (tbf rate;
  this kernel has no netem, so no added delay), node 1 killed (every process at once), node 3's link cut (`ip link
  set down`). For each: time until Ray's GCS marks the node dead, until the controller drops it (and why), until
  node 2's view lacks it; requests failed against those in flight at the fault; jobs the node held, lost, run
  twice; node 3 runs supervised (its `ray start` and `ember serve` restarted when they exit, as docs/cluster.md
  tells an operator): after the heal, when it is back in node 2's view (a new Ray node). Targets: detected
  <= 2 s; 0 jobs lost; failed <= in flight.

Prints markdown tables and writes bench/results/cluster.json (bench/results/cluster-SECTIONS.json with
--sections). Needs root and iproute2 (network namespaces), PostgreSQL and nginx (`make system`).
Usage: python bench/cluster.py [--hot 300 --firsts 12] [--sections peer,...]; sections: placement, hot, streams,
first, peer, faults (faults last: it loses nodes).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import ray
from cluster_faults import faults, sleeper_contract  # bench/, beside this file
from cluster_faults import rows as fault_rows

from ember.cluster.state import ClusterState
from ember.store import StoreConfig, WeightStore
from ember.testing import postgres
from ember.testing.clock import FakeClock
from ember.testing.models import minilm_dir, store_backed_minilm
from ember.testing.netns import NetLab, Netns
from ember.testing.netns_cluster import PORT, NetnsCluster, NetnsNode
from ember.testing.nginx import NginxOrigin
from ember.testing.server import wait_for
from ember.wire import bundle
from ember.wire.contract import example_contracts_dir

IRIS = str(example_contracts_dir() / "iris.yaml")
BODY = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2]}]}
# Streams run while node 0 has a free slot (wordy starts there, not on a node with one), then drop their instance.
SECTIONS = ("placement", "hot", "streams", "first", "peer", "faults")
KEYS = {"peer": "peer_vs_origin"}   # a section's key in the JSON where it differs
TARGET_OVERHEAD_MS, TARGET_FIRST_RATIO, TARGET_PEER = 1.0, 1.2, 3.0
SLEEPER = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "models" / "sleeper.yaml"
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


def placement(cluster: NetnsCluster, n: int) -> dict[str, Any]:
    controller = cluster.controller()
    ray.get(controller.place.remote("iris:1"))
    trips = []
    for _ in range(n):
        t0 = time.perf_counter()
        ray.get(controller.place.remote("iris:1"))
        trips.append(time.perf_counter() - t0)
    view = ray.get(controller.view.remote())
    # A clock that stands still once the state is complete: the nodes stay live (with ttl 0 on the system clock
    # every node expired before each decision, which then placed on an empty cluster).
    clock = FakeClock()
    state = ClusterState(clock, ttl_s=3.0, token=view.token)
    clock.advance(3.0)
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


def _cluster(node: NetnsNode) -> dict[str, Any]:
    status: dict[str, Any] = httpx.get(node.url + "/ember/status", timeout=5).json()["node"]["cluster"]
    return status


def forwarded(node: NetnsNode) -> int:
    return int(_cluster(node)["forwarded"])


def deployed_here(node: NetnsNode, model: str = "iris") -> bool:
    """Whether `model` is deployed on the node (node 2 serves minilm-store too, once the peer row has run)."""
    return any(m["name"] == model for m in httpx.get(node.url + "/ember/status", timeout=5).json()["models"])


def hot(cluster: NetnsCluster, n: int) -> dict[str, Any]:
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


class LoneServer:
    """A lone `ember serve` (no Ray) in a namespace of its own on the cluster's bridge, as a client reaches a node."""

    def __init__(self, cluster: NetnsCluster, state: Path, args: list[str]) -> None:
        assert cluster.lab is not None
        self.ns: Netns = cluster.lab.add("single")
        self.state, self.args = state, args
        self.url = f"http://{self.ns.ip}:{PORT}"

    def __enter__(self) -> LoneServer:
        self.state.mkdir(parents=True, exist_ok=True)
        with (self.state / "serve.log").open("ab") as out:
            proc = self.ns.popen([sys.executable, "-m", "ember", "serve", "--host", self.ns.ip, "--port", str(PORT),
                                  "--state-dir", str(self.state), *self.args], stdout=out, stderr=subprocess.STDOUT)

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"the lone server exited: {(self.state / 'serve.log').read_text()[-2000:]}")
            try:
                return httpx.get(self.url + "/v2/health/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 120)
        return self

    def __exit__(self, *exc: object) -> None:
        self.ns.kill()


def first_requests(cluster: NetnsCluster, root: Path, k: int, single_args: list[str]) -> dict[str, Any]:
    """The three sides interleaved, each after the same idle time, so that all see the same machine: node 2
    places the start on a template node (on its own fresh view, telling the controller after) and forwards it
    there; the same asked at node 0 itself; a single-node `ember serve` beside the cluster, holding what node 0
    holds (`single_args`)."""
    n0, n1, n2 = cluster.nodes
    clustered, same_node, alone = [], [], []
    with httpx.Client(timeout=60) as client, LoneServer(cluster, root / "single", single_args) as single:
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


def streams(cluster: NetnsCluster, n: int, words: int = 10) -> dict[str, Any]:
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


def store_model(root: Path) -> tuple[Path, Path, int]:
    """MiniLM pushed to an origin root, and a models dir with its store-backed contract (no template)."""
    origin = root / "origin"
    with WeightStore(StoreConfig(root=origin, memory_dir=None, fsync=False)) as publisher:
        manifest = publisher.push(minilm_dir(), "minilm:1")
    models = store_backed_minilm(root / "store-models", "minilm-store").parent
    return origin, models, sum(c.size for c in manifest.unique_chunks().values())


def _metric(node: NetnsNode, prefix: str) -> float:
    for line in httpx.get(node.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _first_on(node: NetnsNode) -> float:
    """A start placed on `node` directly, as a gateway forwards one (`POST /cluster/infer`: on plain links with
    keys off no credential; on TLS links only a node's certificate is admitted there, docs/cluster.md)."""
    body = bundle.pack({"text": np.array([b"weights from a peer", b"or the origin"], dtype=object)})
    t0 = time.perf_counter()
    reply = httpx.post(node.url + "/cluster/infer/minilm-store/1", content=body,
                       headers={"content-type": "application/octet-stream"}, timeout=120)
    took = time.perf_counter() - t0
    if reply.status_code != 200:
        raise RuntimeError(f"first request on {node.url}: {reply.status_code} {reply.text}")
    return took


def _reported(cluster: NetnsCluster, node: NetnsNode) -> dict[str, float]:
    """The bandwidths the node reports to the controller once its store measured the fetch (and, a little later,
    the memory-tier fill's disk reads); disk and net are the assumed figures where it has measured none."""
    time.sleep(2.0)   # the fill behind the start, then a report (every 0.5 s)
    inv = next(n for n in ray.get(cluster.controller().view.remote()).nodes if n.node == node.node_id)
    found = {"disk": inv.disk_bps, "net": inv.net_bps}
    return found if inv.origin_bps is None else {**found, "origin": inv.origin_bps}


def peer_vs_origin(cluster: NetnsCluster, size: int) -> dict[str, Any]:
    """The first request for the store-backed model on node 1 (origin), then on node 2 (peer: node 1)."""
    _, n1, n2 = cluster.nodes
    fetch = 'ember_cold_start_phase_seconds_sum{model="minilm-store",phase="fetch"'
    out: dict[str, Any] = {"bytes": size, "origin_mib_s": ORIGIN_MIB_S, "connections": STORE_THREADS}
    # Run alone (--sections peer) the nodes may not have the registry yet: the controller's, then a report round.
    wait_for(lambda: any(c.key == "minilm-store:1" for c in ray.get(cluster.controller().view.remote()).contracts), 30)
    time.sleep(1.5)
    for source, node in (("origin", n1), ("peer", n2)):
        total = _first_on(node)
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
    parser.add_argument("--gateway-links", choices=("on", "off"), default="on",
                        help="the nodes' `ember serve --gateway-links` (off: forwarded over HTTP)")
    parser.add_argument("--keep", action="store_true", help="keep the nodes' state, stores and logs (a temp dir)")
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
    try:
        result = measure(root, sections, args)
    finally:   # the nodes' stores hold a model each: hundreds of MB a run
        if args.keep:
            print(f"kept the nodes' state and logs in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    result["machine"] = {"python": platform.python_version(), "ray": ray.__version__, "cpu": platform.processor()}
    table = report(result)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    args.out.with_suffix(".md").write_text(table + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


def measure(root: Path, sections: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The cluster in network namespaces under `root`, and the rows of `sections`."""
    origin_root, store_models, size = store_model(root)
    per_connection = f"{ORIGIN_MIB_S // STORE_THREADS}m"
    lab = NetLab(root / "lab")   # the machines' network: the job store and the origin listen on its host address
    with (postgres.PostgresServer(host=lab.host_ip) as pg,
          NginxOrigin(origin_root, slow_rate=per_connection, host=lab.host_ip) as origin):
        common = ["--no-examples", "--auth", "off", "--sandbox", "off", "--jobs-url", pg.create_database("jobs"),
                  "--request-timeout-s", "10", "--queue-wait-s", "5", "--store-origin", origin.slow_url,
                  "--gateway-links", args.gateway_links]
        sleeper = str(sleeper_contract(root, SLEEPER))
        nodes = [[*common, "--models", IRIS, "--models", str(store_models), "--models", str(wordy_contract(root)),
                  "--cpu-slots", "2"],
                 [*common, "--models", IRIS, "--models", sleeper, "--cpu-slots", "2"], [*common, "--cpu-slots", "1"]]
        extra = [*common, "--models", IRIS, "--models", sleeper, "--cpu-slots", "2",
                 "--store-root", str(root / "store3")]
        # The single node holds what node 0 holds (the same models, slots and flags, its own store), with the
        # single-node job store (SQLite): the difference is what being in the cluster costs.
        single = [a for a in nodes[0] if not a.startswith("postgresql://") and a != "--jobs-url"]
        single += ["--store-root", str(root / "store-single")]
        for i, node_args in enumerate(nodes):
            node_args += ["--store-root", str(root / f"store{i}")]
        rows: dict[str, Callable[[NetnsCluster], Any]] = {
            "placement": lambda c: placement(c, args.place), "hot": lambda c: hot(c, args.hot),
            "first": lambda c: first_requests(c, root, args.firsts, single), "peer": lambda c: peer_vs_origin(c, size),
            "faults": lambda c: faults(c, root, extra), "streams": lambda c: streams(c, args.streams)}
        result: dict[str, Any] = {}
        with NetnsCluster(root, nodes, lab=lab) as cluster:
            result["network"] = {"host": lab.host_ip, "gateway_links": args.gateway_links,
                                 "nodes": [n.ip for n in cluster.nodes], "health_check": cluster.system_config}
            for name in SECTIONS:   # in this order whatever was asked: faults lose nodes
                if name in sections:
                    result[KEYS.get(name, name)] = rows[name](cluster)
    return result


class Table:
    """The report's rows, rendered as a markdown table."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, ...]] = []

    def add_row(self, *cells: str) -> None:
        self.rows.append(tuple(cells))

    def markdown(self) -> str:
        lines = ["| row | measured | target | met |", "|---|---|---|---|"]
        return "\n".join(lines + ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in self.rows])


def report(r: dict[str, Any]) -> str:
    table = Table()
    for key, rows in (("placement", _placement_rows), ("hot", _hot_rows), ("first", _first_rows),
                      ("peer_vs_origin", _peer_rows), ("streams", _stream_rows)):
        if key in r:
            rows(table, r[key])
    for row in fault_rows(r["faults"]) if "faults" in r else []:
        table.add_row(*row)
    return table.markdown()


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
