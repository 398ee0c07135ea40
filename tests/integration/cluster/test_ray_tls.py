"""A Ray cluster with secured links, end to end: two nodes, each `ember serve --ray --tls-dir` with a certificate
of one cluster CA, keys on and kept in the shared job database. A request with a key made once for the cluster
reaches the gateway-only node and is forwarded over mutual TLS to the node serving the model; the serving
node's cluster route refuses a client without a node certificate; a revoked key is refused by both."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from ember.cluster.ca import init_ca
from ember.cluster.one_host import LocalCluster
from ember.keys.postgres import PgKeys
from ember.testing import postgres
from ember.wire import bundle
from ember.wire.contract import example_contracts_dir

pytestmark = pytest.mark.slow

IRIS = str(example_contracts_dir() / "iris.yaml")
BODY = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2]}]}


def test_a_request_is_forwarded_over_mutual_tls_with_the_clusters_key(
        tmp_path: Path, pg_server: postgres.PostgresServer) -> None:
    jobs = pg_server.create_database("ray_tls_jobs")
    keys = PgKeys(jobs)
    _, admin = keys.create("ops", "admin")
    user_record, user = keys.create("acme", "user")
    init_ca(tmp_path / "pki")
    common = ["--no-examples", "--sandbox", "off", "--jobs-url", jobs, "--auth", "on", "--models", IRIS]
    with LocalCluster(tmp_path / "nodes", [[*common, "--cpu-slots", "0"], [*common, "--cpu-slots", "1"]],
                      tls=tmp_path / "pki", headers={"authorization": f"Bearer {admin}"}) as cluster:
        head, worker = cluster.nodes
        assert head.url.startswith("https://")
        with httpx.Client(verify=cluster.verify, timeout=30) as client:
            served = client.post(head.url + "/v2/models/iris/infer", json=BODY,
                                 headers={"authorization": f"Bearer {user}"})
            assert served.status_code == 200, served.text
            status = client.get(head.url + "/ember/status", headers={"authorization": f"Bearer {admin}"}).json()
            assert status["node"]["cluster"]["forwarded"] == 1    # served by the worker, through the head
            direct = client.post(worker.url + "/cluster/infer/iris/1", content=bundle.pack({}),
                                 headers={"authorization": f"Bearer {user}",
                                          "content-type": "application/octet-stream"})
            assert direct.status_code == 403 and "node certificate" in direct.text
            keys.revoke(user_record.id)
            deadline = time.monotonic() + 5
            while client.post(head.url + "/v2/models/iris/infer", json=BODY,
                              headers={"authorization": f"Bearer {user}"}).status_code != 401:
                assert time.monotonic() < deadline, "the revoked key still works after 5 s"
                time.sleep(0.05)
    keys.close()
