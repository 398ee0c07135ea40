"""A gateway-only node (`--cpu-slots 0`, as on the head of deploy/kuberay): it deploys nothing, offers its
models to the cluster, forwards requests to the nodes that serve them, and with no such node left (a worker
group scaled to zero) turns a request into a durable job and has the controller ask for a machine; the node
that then joins runs the job. A Ray cluster on this machine (a head with no CPUs, two nodes), one PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")

from ember.cluster.one_host import LocalCluster, RayletNode  # noqa: E402
from ember.testing import postgres  # noqa: E402
from ember.testing.server import wait_for  # noqa: E402
from ember.wire.contract import example_contracts_dir  # noqa: E402

pytestmark = pytest.mark.slow

IRIS = str(example_contracts_dir() / "iris.yaml")
BODY = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2]}]}


def nodes_seen(node: RayletNode) -> int:
    return len(httpx.get(node.url + "/ember/status", timeout=5).json()["node"]["cluster"]["nodes"])


def test_a_gateway_only_node_forwards_then_queues_for_a_machine_that_runs_the_job(
        tmp_path: Path, pg_server: postgres.PostgresServer) -> None:
    common = ["--no-examples", "--sandbox", "off", "--jobs-url", pg_server.create_database("gateway_only_jobs"),
              "--request-timeout-s", "10", "--queue-wait-s", "2", "--models", IRIS]
    gateway, worker = [*common, "--cpu-slots", "0"], [*common, "--cpu-slots", "1"]
    with LocalCluster(tmp_path, [gateway, worker]) as cluster:
        head, node = cluster.nodes
        status = httpx.get(head.url + "/ember/status", timeout=5).json()
        assert status["models"] == []                           # nothing deployed on the gateway, no process
        served = httpx.post(head.url + "/v2/models/iris/infer", json=BODY, timeout=30)
        assert served.status_code == 200, served.text
        forwarded = httpx.get(head.url + "/ember/status", timeout=5).json()["node"]["cluster"]["forwarded"]
        assert forwarded == 1                                   # served by the worker, through the head

        cluster.remove_node(node)                               # the worker group at zero
        wait_for(lambda: nodes_seen(head) == 1, 20)
        queued = httpx.post(head.url + "/v2/models/iris/infer", json=BODY, timeout=30)
        assert queued.status_code == 202, queued.text            # no node to serve it: a durable job
        asked = wait_for(lambda: (a := ray.get(cluster.controller().scale_request.remote()))[0] and a, 10)
        assert asked[0] >= 1 and "iris:1" in asked[1]            # and the controller asked Ray for a machine

        cluster.add_node(worker)                                # the machine an autoscaler would bring
        location = queued.headers["location"]
        done = wait_for(lambda: (j := httpx.get(head.url + location, timeout=5).json()).get("status")
                        == "succeeded" and j, 60)
        assert done["status"] == "succeeded"
