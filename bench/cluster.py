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
  asked through node 2's gateway, vs the same on a single-node `ember serve`; target: within 1.2×;
- recovery: node 1 removed (`remove_node`) under traffic through node 2; the time until every request
  succeeds again (target ≤ 5 s), and the jobs node 1 had claimed, run elsewhere (target: zero lost);
- peer vs origin fetch: a hook for the weight store's peer tier (another part of issue 14), not measured here.

Prints a table and writes bench/results/cluster.json. Usage: python bench/cluster.py [--hot 300 --firsts 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import ray
from rich.console import Console
from rich.table import Table

from ember.clock import SystemClock
from ember.cluster.local import LocalCluster, LocalNode
from ember.cluster.state import ClusterState
from ember.testing import postgres
from ember.testing.server import EmberServer, wait_for
from ember.wire.contract import example_contracts_dir

IRIS = str(example_contracts_dir() / "iris.yaml")
BODY = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2]}]}
TARGET_OVERHEAD_MS, TARGET_FIRST_RATIO, TARGET_RECOVERY_S = 2.0, 1.2, 5.0


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


def deployed_here(node: LocalNode) -> bool:
    return bool(httpx.get(node.url + "/ember/status", timeout=5).json()["models"])


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


def _first_setup(client: httpx.Client, url: str) -> None:
    assert client.post(url + "/v2/repository/models/iris/load").status_code == 200
    wait_for(lambda: not client.get(url + "/ember/status").json()["models"][0]["instances"], 60)


def _first(client: httpx.Client, load_on: str, ask: str, wait_view: LocalNode | None) -> float:
    """Re-deploy iris on `load_on` (a template, no instance), then time the first request through `ask`."""
    assert client.post(load_on + "/v2/repository/models/iris/load").status_code == 200
    wait_for(lambda: client.get(load_on + "/v2/health/ready").status_code == 200, 60)
    wait_for(lambda: not client.get(load_on + "/ember/status").json()["models"][0]["instances"], 60)
    if wait_view is not None:   # the asking gateway has seen the fresh deploy (no warm instance anywhere)
        time.sleep(1.5)
    t0 = time.perf_counter()
    reply = client.post(ask + "/v2/models/iris/infer", json=BODY)
    took = time.perf_counter() - t0
    if reply.status_code != 200:
        raise RuntimeError(f"first request: {reply.status_code} {reply.text}")
    return took


def first_requests(cluster: LocalCluster, root: Path, k: int) -> dict[str, Any]:
    n0, n1, n2 = cluster.nodes
    with httpx.Client(timeout=60) as client:
        clustered = []
        for _ in range(k):
            # Both iris nodes redeployed (a template each, no instance): node 2 asks the controller, which places
            # the start on a template node; node 2 forwards it there.
            _first_setup(client, n1.url)
            clustered.append(_first(client, n0.url, n2.url, n2))
        with EmberServer(root / "single", "--models", IRIS, "--cpu-slots", "2", "--sandbox", "off") as single:
            alone = [_first(client, single.url, single.url, None) for _ in range(k)]
    result: dict[str, Any] = {"cluster_template_node": stats_ms(clustered), "single_node": stats_ms(alone),
                              "node2_serves_iris": deployed_here(n2)}
    result["ratio_p50"] = result["cluster_template_node"]["p50_ms"] / result["single_node"]["p50_ms"]
    return result


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


def peer_vs_origin(cluster: LocalCluster) -> dict[str, Any] | None:
    """HOOK (issue 14, the weight store's peer tier, built elsewhere): a cold start whose chunks come from a peer
    node (the controller's `holders(model)`) vs from a throttled origin. Returns None until that tier exists."""
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hot", type=int, default=300, help="hot requests per side")
    parser.add_argument("--firsts", type=int, default=5, help="first requests per side")
    parser.add_argument("--place", type=int, default=300, help="placement decisions")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cluster.json")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ember-bench-cluster-"))
    with postgres.PostgresServer() as pg:
        common = ["--no-examples", "--sandbox", "off", "--jobs-url", pg.create_database("jobs"),
                  "--request-timeout-s", "5", "--queue-wait-s", "5"]
        nodes = [[*common, "--models", IRIS, "--cpu-slots", "2"], [*common, "--models", IRIS, "--cpu-slots", "2"],
                 [*common, "--cpu-slots", "1"]]
        with LocalCluster(root, nodes) as cluster:
            result: dict[str, Any] = {"placement": placement(cluster, args.place), "hot": hot(cluster, args.hot),
                                      "first": first_requests(cluster, root, args.firsts)}
            result["recovery"] = recovery(cluster)
            result["peer_vs_origin"] = peer_vs_origin(cluster)
    result["machine"] = {"python": platform.python_version(), "ray": ray.__version__, "cpu": platform.processor()}
    report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


def report(r: dict[str, Any]) -> None:
    table = Table(title="ember on a Ray cluster of this machine (3 nodes, one run)")
    for col in ("row", "measured", "target", "met"):
        table.add_column(col)
    p, h, f, rec = r["placement"], r["hot"], r["first"], r["recovery"]
    table.add_row("place: controller actor call (gateway's cost)",
                  f"p50 {p['actor_call']['p50_ms']:.2f} ms, p99 {p['actor_call']['p99_ms']:.2f} ms", "-", "-")
    table.add_row(f"place: in the controller ({p['nodes']} nodes)",
                  f"p50 {p['in_controller']['p50_ms'] * 1000:.0f} µs, p99 {p['in_controller']['p99_ms'] * 1000:.0f} µs",
                  "-", "-")
    table.add_row("hot request, local (node 0)",
                  f"p50 {h['local']['p50_ms']:.2f} ms, p99 {h['local']['p99_ms']:.2f} ms", "-", "-")
    table.add_row(f"hot request, through node 2 ({h['forwarded_by_node2']} forwarded; iris deployed on node 2: "
                  f"{h['node2_serves_iris']})", f"p50 {h['through_another_node']['p50_ms']:.2f} ms, "
                  f"p99 {h['through_another_node']['p99_ms']:.2f} ms", "-", "-")
    table.add_row("  overhead, p50", f"{h['overhead_p50_ms']:.2f} ms", f"≤ {TARGET_OVERHEAD_MS:g} ms",
                  str(h["overhead_p50_ms"] <= TARGET_OVERHEAD_MS))
    table.add_row("first request, template node via node 2", f"p50 {f['cluster_template_node']['p50_ms']:.0f} ms", "-",
                  "-")
    table.add_row("first request, single-node ember serve", f"p50 {f['single_node']['p50_ms']:.0f} ms", "-", "-")
    table.add_row("  ratio, p50", f"{f['ratio_p50']:.2f}×", f"≤ {TARGET_FIRST_RATIO:g}×",
                  str(f["ratio_p50"] <= TARGET_FIRST_RATIO))
    table.add_row("recovery after remove_node", f"{rec['recovery_s']:.2f} s ({rec['failed_after_removal']} of "
                  f"{rec['requests_after_removal']} requests failed: {rec['failed_statuses']}; "
                  f"{rec['retried_elsewhere']} retried elsewhere; iris on node 2 too: "
                  f"{rec['node2_serves_iris_at_removal']})",
                  f"≤ {TARGET_RECOVERY_S:g} s", str(rec["recovery_s"] <= TARGET_RECOVERY_S))
    table.add_row("  jobs of the removed node", f"{rec['jobs_succeeded']}/{rec['jobs_on_removed_node']} succeeded "
                  "elsewhere", "0 lost", str(rec["jobs_lost"] == 0))
    table.add_row("peer vs origin fetch", "not measured: hook for the weight store's peer tier", "-", "-")
    Console().print(table)


if __name__ == "__main__":
    main()
