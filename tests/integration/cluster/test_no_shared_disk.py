"""No shared disk on a Ray cluster: a model given to one node as a contract directory in the weight store
(`--models store:scaler:1`, nginx the origin) is served through another node, and once its only node is gone
(and that node's store and state directories deleted), its jobs are taken up by the other node, which writes the
directory out of its own store: no node ever reads another's path. A Ray cluster on this machine (a head with no
CPUs, two nodes, each its own store root and state directory), one PostgreSQL job store."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file

ray = pytest.importorskip("ray")

from ember.cluster.one_host import LocalCluster, RayletNode  # noqa: E402
from ember.store import StoreConfig, WeightStore  # noqa: E402
from ember.testing import postgres  # noqa: E402
from ember.testing.nginx import NginxOrigin  # noqa: E402
from ember.testing.nginx import available as nginx_available  # noqa: E402
from ember.testing.server import wait_for  # noqa: E402

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "bundles" / "scaler"
BODY = {"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]}]}


@pytest.fixture
def origin(tmp_path: Path) -> Iterator[NginxOrigin]:
    if not nginx_available():
        pytest.fail("nginx is not installed: run `make system`")
    src = tmp_path / "pushed" / "scaler"
    shutil.copytree(FIXTURE, src)
    (src / "weights").mkdir()
    save_file({"scale": np.array([2.5], np.float32)}, str(src / "weights" / "scale.safetensors"))
    with WeightStore(StoreConfig(root=tmp_path / "origin", memory_dir=None)) as publisher:
        publisher.push(src, "scaler:1")
    shutil.rmtree(tmp_path / "pushed")
    with NginxOrigin(tmp_path / "origin") as nginx:
        yield nginx


def outputs(reply: dict[str, Any]) -> dict[str, Any]:
    return {o["name"]: o["data"] for o in reply["outputs"]}


def nodes_seen(node: RayletNode) -> int:
    return len(httpx.get(node.url + "/ember/status", timeout=5).json()["node"]["cluster"]["nodes"])


def test_a_store_model_is_served_across_nodes_and_taken_up_from_the_store_not_a_path(
        tmp_path: Path, origin: NginxOrigin, pg_server: postgres.PostgresServer) -> None:
    common = ["--no-examples", "--sandbox", "off", "--jobs-url", pg_server.create_database("no_shared_disk"),
              "--request-timeout-s", "10", "--queue-wait-s", "2", "--store-origin", origin.url, "--cpu-slots", "1"]
    stores = [tmp_path / "store-a", tmp_path / "store-b"]
    given = [*common, "--models", "store:scaler:1", "--store-root", str(stores[0])]   # node 0: the model
    bare = [*common, "--store-root", str(stores[1])]                                  # node 1: nothing
    try:
        with LocalCluster(tmp_path, [given, bare]) as cluster:
            n0, n1 = cluster.nodes
            reply = httpx.post(n1.url + "/v2/models/scaler/infer", json=BODY, timeout=60)
            assert reply.status_code == 200, reply.text
            y, source = outputs(reply.json())["y"], outputs(reply.json())["source"][0]
            assert y == [2.5, 5.0] and Path(source).is_relative_to(stores[0])   # served on node 0, through node 1

            cluster.remove_node(n0)                  # its only node is gone, and with it all it had on disk
            shutil.rmtree(stores[0])
            shutil.rmtree(n0.state_dir, ignore_errors=True)
            wait_for(lambda: nodes_seen(n1) == 1, 20)
            queued = httpx.post(n1.url + "/v2/models/scaler/infer", json=BODY, headers={"Prefer": "respond-async"},
                                timeout=30)
            assert queued.status_code == 202, queued.text
            location = queued.headers["location"]
            done = wait_for(lambda: (j := httpx.get(n1.url + location, timeout=5).json()).get("status")
                            in ("succeeded", "failed") and j, 90)
            assert done["status"] == "succeeded", done
            y, source = outputs(done["response"])["y"], outputs(done["response"])["source"][0]
            assert y == [2.5, 5.0] and Path(source).is_relative_to(stores[1])   # written out of node 1's store
    finally:
        for root in stores:
            memory = StoreConfig(root=root).memory_dir
            if memory is not None:
                shutil.rmtree(memory, ignore_errors=True)
