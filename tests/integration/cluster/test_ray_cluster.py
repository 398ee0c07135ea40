"""ember on a Ray cluster of three nodes on this machine (`ray.cluster_utils.Cluster`; a head with no CPUs for
the controller actor): requests through any gateway, placement from real inventories, the weight store's peer
tier (a store-backed model's chunks from another node, not the nginx origin; placement then prefers the node
holding them), a stream through a node the streaming model is not on (and its client walking away), the
controller killed under traffic, and a node removed under traffic with its jobs (one
PostgreSQL job store) run elsewhere.

One module-scoped cluster; the node removal comes last, as it takes a node away for good."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ember.cluster.one_host import LocalCluster, RayletNode  # noqa: E402
from ember.core.placement import Placed  # noqa: E402
from ember.core.states import Rung  # noqa: E402
from ember.store import StoreConfig, WeightStore  # noqa: E402
from ember.testing import postgres  # noqa: E402
from ember.testing.nginx import NginxOrigin  # noqa: E402
from ember.testing.nginx import available as nginx_available  # noqa: E402
from ember.testing.server import wait_for  # noqa: E402
from ember.wire import bundle  # noqa: E402
from ember.wire.contract import example_contracts_dir  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SLEEPER = str(ROOT / "fixtures" / "models" / "sleeper.yaml")
WEIGHED = str(ROOT / "fixtures" / "models" / "weighed.yaml")     # weights: store:weighed:1, no template
WEIGHTS_BYTES = 20 << 20                                          # two chunks of the store's 16 MiB
WORDY = ROOT / "fixtures" / "models" / "wordy.yaml"                # streams one word per reply
IRIS = str(example_contracts_dir() / "iris.yaml")
IRIS_BODY = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2]}]}


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NginxOrigin]:
    """A real nginx origin holding weighed's weights (its access log says which chunks were fetched)."""
    if not nginx_available():
        pytest.fail("nginx is not installed: run `make system`")
    root = tmp_path_factory.mktemp("origin")
    weights = root.parent / "weighed.bin"
    weights.write_bytes(os.urandom(WEIGHTS_BYTES))
    with WeightStore(StoreConfig(root=root, memory_dir=None)) as publisher:
        publisher.push(weights, "weighed:1")
    with NginxOrigin(root) as nginx:
        yield nginx


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, origin: NginxOrigin) -> Iterator[LocalCluster]:
    if not postgres.available():
        pytest.fail("PostgreSQL is not installed: run `make system` (apt-get install postgresql)")
    base = tmp_path_factory.mktemp("cluster")
    wordy = base / "models" / "wordy.yaml"        # wordy writes how far a stream got to wordy.json
    wordy.parent.mkdir()
    wordy.write_text(WORDY.read_text().replace("options: {delay_s: 0.05}",
                                               f"options: {{delay_s: 0.05, log: '{base / 'wordy.json'}'}}"))
    (wordy.parent / "wordy").symlink_to(WORDY.parent / "wordy")
    with postgres.PostgresServer() as pg:
        common = ["--no-examples", "--sandbox", "off", "--jobs-url", pg.create_database("jobs"),
                  "--request-timeout-s", "3", "--queue-wait-s", "5", "--store-origin", origin.url]
        args = [[*common, "--models", IRIS, "--models", SLEEPER, "--models", WEIGHED, "--cpu-slots", "2"],
                [*common, "--models", SLEEPER, "--models", str(wordy), "--cpu-slots", "2"],  # node 1: sleeper, wordy
                [*common, "--cpu-slots", "1"]]                                            # node 2: nothing
        for i, node_args in enumerate(args):    # each node its own weight store (the default is per user)
            node_args += ["--store-root", str(base / f"store{i}")]
        with LocalCluster(base, args) as c:
            yield c


def iris(node: RayletNode) -> httpx.Response:
    return httpx.post(node.url + "/v2/models/iris/infer", json=IRIS_BODY, timeout=30)


def sleep(node: RayletNode, seconds: float, prefer_async: bool = False) -> httpx.Response:
    body = {"inputs": [{"name": "seconds", "shape": [1], "datatype": "FP32", "data": [seconds]}]}
    headers = {"Prefer": "respond-async"} if prefer_async else {}
    return httpx.post(node.url + "/v2/models/sleeper/infer", json=body, headers=headers, timeout=60)


def cluster_status(node: RayletNode) -> dict[str, Any]:
    status: dict[str, Any] = httpx.get(node.url + "/ember/status", timeout=5).json()["node"]["cluster"]
    return status


def test_a_request_through_any_gateway_reaches_a_model_placed_on_another_node(cluster: LocalCluster) -> None:
    n0, n1, n2 = cluster.nodes
    assert iris(n0).status_code == 200                     # warm on node 0
    for node in (n1, n2):
        reply = iris(node)
        assert reply.status_code == 200, reply.text
        assert reply.json()["outputs"][2]["data"] == ["setosa"]
        assert cluster_status(node)["forwarded"] >= 1
    assert cluster_status(n0)["forwarded"] == 0            # node 0 served its own


def chat_stream(node: RayletNode, words: int) -> Iterator[str]:
    """The text of each SSE event of a streamed chat completion through `node`'s gateway, as it comes."""
    body = {"model": "wordy", "stream": True, "messages": [{"role": "user", "content": " ".join(["w"] * words)}]}
    with httpx.stream("POST", node.url + "/v1/chat/completions", json=body, timeout=30) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                yield json.loads(line[6:])["choices"][0]["delta"].get("content", "")


def test_a_stream_through_another_node_and_its_client_walking_away(cluster: LocalCluster) -> None:
    n2 = cluster.nodes[2]
    before = cluster_status(n2)["forwarded"]
    assert "".join(chat_stream(n2, 3)) == "w w w "          # wordy is on node 1 only: forwarded there
    assert cluster_status(n2)["forwarded"] == before + 1
    log = cluster.root / "wordy.json"
    log.unlink(missing_ok=True)
    events = chat_stream(n2, 400)                           # 20 s of words; the client leaves after one
    assert next(e for e in events if e) == "w "
    events.close()
    wait_for(lambda: log.exists() and json.loads(log.read_text())["of"] == 400, 10)
    assert json.loads(log.read_text())["yielded"] < 100     # node 1's generator was closed long before its end


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a process's priority needs CAP_SYS_NICE")
def test_each_nodes_serve_and_its_zygotes_run_at_normal_priority_not_rays_worker_niceness(  # join.normal_priority
        cluster: LocalCluster) -> None:
    pids = []
    for node in cluster.nodes:
        pid = ray.get(node.agent.info.remote())["pid"]
        pids += [pid, *map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]
    assert len(pids) > len(cluster.nodes)       # nodes 0 and 1 serve models: their zygotes are there
    assert {p: os.getpriority(os.PRIO_PROCESS, p) for p in pids} == dict.fromkeys(pids, 0)


def test_placement_prefers_the_node_holding_the_template(cluster: LocalCluster) -> None:
    n0 = cluster.nodes[0]
    controller = cluster.controller()
    placed = ray.get(controller.place.remote("iris:1"))
    assert isinstance(placed, Placed) and (placed.node, placed.rung) == (n0.node_id, Rung.TEMPLATE)
    # Without node 0, no node holds a template of iris: a zygote start where its weights are local.
    other = ray.get(controller.place.remote("iris:1", (n0.node_id,)))
    assert isinstance(other, Placed) and other.rung is Rung.ZYGOTE and other.weights == "local"
    # The peer tier's hook: every node here reads iris's weight file locally.
    holders = ray.get(controller.holders.remote("iris:1"))
    assert {h.node for h in holders} == {n.node_id for n in cluster.nodes}


def chunk_fetches(origin: NginxOrigin) -> list[str]:
    return [p for p in origin.requests() if "/chunks/" in p]


def fetched_bytes(node: RayletNode) -> dict[str, float]:
    """`ember_store_fetched_bytes_total` by source, from the node's /metrics."""
    out = {}
    for line in httpx.get(node.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("ember_store_fetched_bytes_total{"):
            out[line.split('source="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def held(cluster: LocalCluster, node: RayletNode, model: str) -> Any:
    inv = inventory(cluster, node)
    return next((h for h in inv.held if h.model == model), None)


def inventory(cluster: LocalCluster, node: RayletNode) -> Any:
    view = ray.get(cluster.controller().view.remote())
    return next(n for n in view.nodes if n.node == node.node_id)


def test_a_node_pulls_a_store_backed_models_chunks_from_a_peer_and_placement_then_prefers_it(
        cluster: LocalCluster, origin: NginxOrigin) -> None:
    n0, n1, n2 = cluster.nodes

    def start_on(node: RayletNode) -> np.ndarray:
        """A start of weighed placed on `node` (as a gateway forwards one there): its first request."""
        reply = httpx.post(node.url + "/cluster/infer/weighed/1", content=bundle.pack({"x": np.zeros(1, np.float32)}),
                           timeout=60)
        assert reply.status_code == 200, reply.text
        out: np.ndarray = bundle.unpack(reply.content, "cluster body")["bytes"]
        return out

    assert start_on(n0).tolist() == [WEIGHTS_BYTES]                    # node 0: from the origin
    from_origin = chunk_fetches(origin)
    assert len(from_origin) == len(set(from_origin)) >= 2
    # Node 0 reports weighed's real size, all local; nodes 1 and 2 report none of it local.
    wait_for(lambda: (h := held(cluster, n0, "weighed:1")) is not None and h.bytes >= WEIGHTS_BYTES
             and h.local_bytes == h.bytes, 10)
    assert all(held(cluster, n, "weighed:1").local_bytes == 0 for n in (n1, n2))
    placed = ray.get(cluster.controller().place.remote("weighed:1", (n0.node_id,)))
    assert isinstance(placed, Placed) and placed.rung is Rung.FETCH        # without node 0: nobody holds them
    assert start_on(n2).tolist() == [WEIGHTS_BYTES]                    # node 2: its store pulls from node 0
    assert chunk_fetches(origin) == from_origin                       # not one chunk more from the origin
    # The metric follows the node's tick, which may have sampled the pull half way: wait for the whole model.
    got = wait_for(lambda: (f := fetched_bytes(n2)).get("peer", 0) >= WEIGHTS_BYTES and f, 10)
    assert got.get("origin", 0) == 0 and got["peer"] >= WEIGHTS_BYTES
    # Node 2 now holds the chunks (no instance left there): without node 0, placement prefers it over node 1.
    assert httpx.post(n2.url + "/v2/repository/models/weighed/unload", timeout=30).status_code == 200
    wait_for(lambda: (h := held(cluster, n2, "weighed:1")) is not None and h.local_bytes >= WEIGHTS_BYTES
             and h.paused == 0 and inventory(cluster, n2).free_slices.get("cpu"), 10)
    placed = ray.get(cluster.controller().place.remote("weighed:1", (n0.node_id,)))
    assert isinstance(placed, Placed) and (placed.node, placed.rung, placed.weights) == (n2.node_id, Rung.ZYGOTE,
                                                                                       "local")


def test_the_controller_killed_hot_traffic_flows_and_its_state_is_rebuilt(cluster: LocalCluster) -> None:
    n0, _, n2 = cluster.nodes
    before = ray.get(cluster.controller().view.remote())
    ray.kill(cluster.controller(), no_restart=False)
    statuses = [iris(node).status_code for _ in range(5) for node in (n0, n2)]
    assert statuses == [200] * len(statuses)
    after = wait_for(lambda: len((v := ray.get(cluster.controller().view.remote())).nodes) == 3 and v, 30)
    assert [n.node for n in after.nodes] == [n.node for n in before.nodes]
    assert after.token == before.token and {c.key for c in after.contracts} == {c.key for c in before.contracts}


def test_a_node_removed_under_traffic_disturbs_nothing_else_and_loses_no_job(cluster: LocalCluster) -> None:
    n0, n1, n2 = cluster.nodes
    assert sleep(n0, 0).status_code == 200 and sleep(n1, 0).status_code == 200   # warm on both
    jobs = [sleep(n1, 1.0, prefer_async=True) for _ in range(3)]                # node 1's own jobs
    assert all(j.status_code == 202 for j in jobs), [j.text for j in jobs]
    results: list[tuple[float, int]] = []
    hot: list[int] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            started = time.monotonic()
            results.append((started, sleep(n2, 0.3).status_code))

    def iris_traffic() -> None:
        while not stop.is_set():
            hot.append(iris(n0).status_code)

    threads = [threading.Thread(target=traffic) for _ in range(2)] + [threading.Thread(target=iris_traffic)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    removed_at = time.monotonic()
    cluster.remove_node(n1)
    time.sleep(8)
    stop.set()
    for t in threads:
        t.join(60)
    assert set(hot) == {200}, hot                                          # nothing else disturbed
    assert {s for _, s in results} <= {200, 202, 502}, results
    assert [s for t, s in results if t > removed_at + 5] and all(s in (200, 202) for t, s in results
                                                                   if t > removed_at + 5)
    status = cluster_status(n2)
    assert n1.node_id not in {n["node"] for n in status["nodes"]}
    failed = sum(1 for _, s in results if s == 502)
    assert failed <= 2                      # at most the two in flight there when it went (retried, else 502)
    for job in jobs:                        # leases run out (2 x 3 s) and node 0 runs them: none lost
        location = job.headers["location"]
        done = wait_for(lambda loc=location: (j := httpx.get(n0.url + loc).json()).get("status") == "succeeded"
                        and j, 40)
        assert done["status"] == "succeeded"


def test_jobs_of_a_model_whose_only_node_left_are_taken_up_by_another_node(cluster: LocalCluster) -> None:
    """After the test above removed node 1, wordy (node 1's alone) stays registered; its jobs, submitted through a
    node that does not serve it, are taken up: the controller gives it to a node with room, which deploys it and
    claims them (`ember.core.backlog`)."""
    n0, n2 = cluster.nodes                                   # node 1 was removed
    assert len(cluster_status(n2)["nodes"]) == 2
    body = {"inputs": [{"name": "request", "shape": [1], "datatype": "BYTES", "data": ['{"prompt": "one two"}']}]}
    reply = httpx.post(n2.url + "/v2/models/wordy/infer", json=body, headers={"Prefer": "respond-async"}, timeout=30)
    assert reply.status_code == 202, reply.text
    location = reply.headers["location"]
    done = wait_for(lambda: (j := httpx.get(n2.url + location).json()).get("status") == "succeeded" and j, 30)
    assert done["status"] == "succeeded"
    serving = wait_for(lambda: [n for n in (n0, n2) if "wordy:1" in inventory(cluster, n).serving], 10)
    assert len(serving) == 1                                 # one node took it up
