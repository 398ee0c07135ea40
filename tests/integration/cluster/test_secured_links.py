"""Two real gateways on loopback, each on uvicorn with its node certificate of one cluster CA (`ember cluster init`),
one cluster-wide key store: node A's ClusterService forwards to node B over mutual TLS, and B admits each
forwarded request as its caller's (key, tenant, rate limit), with no shared token. No Ray: A's view of the
cluster is set by the test (B holds a warm instance), and B's node is the fake service."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("aiohttp")

from ember.cluster.ca import init_ca, issue
from ember.cluster.forward import Forwarder
from ember.cluster.service import ClusterService, ClusterSettings
from ember.core.placement import Placement
from ember.core.ratelimit import RateLimit, RateLimiter
from ember.gateway.app import create_app
from ember.gateway.auth import Auth
from ember.gateway.caller import forwarded_headers
from ember.gateway.cluster_api import cluster_routes
from ember.gateway.connections import guarded_protocol
from ember.keys.store import KeyFile, SharedKeyRing
from ember.metrics import Metrics
from ember.serving.results import InferResult, InferStream, JobAccepted
from ember.testing.asgi import ThreadedServer
from ember.testing.controller import World
from ember.testing.service import FakeService, fake_contracts
from ember.tls import NodeTls
from ember.wire import bundle
from ember.wire.cluster import ClusterView, NodeInventory, Warm
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

AFFINE = next(c for c in fake_contracts() if c.name == "affine").model_copy(update={"tenant": "acme"})
BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
REFRESH_S = 0.2


@dataclass
class NodeB:
    """Node B's side of the cluster routes over the fake service; records who each request was for."""

    fake: FakeService
    seen: list[dict[str, Any]] = field(default_factory=list)

    async def serve_forwarded(self, contract: ModelContract, inputs: Tensors,
                              tenant: str | None) -> InferResult | JobAccepted:
        self.seen.append({"tenant": tenant, **forwarded_headers()})
        return await self.fake.infer(contract, inputs, tenant=tenant)

    async def serve_stream(self, contract: ModelContract, inputs: Tensors, tenant: str | None = None) -> InferStream:
        return await self.fake.stream(contract, inputs)


class NoController:
    async def report(self, inventory: NodeInventory) -> ClusterView:
        raise ConnectionError("no controller in this test")

    async def place(self, model: str, avoid: tuple[str, ...], here: str | None = None) -> Placement:
        raise ConnectionError("no controller in this test")

    def placed(self, placement: Any) -> None:
        pass


def view_with_b(url: str) -> ClusterView:
    b = NodeInventory(node="b", url=url, memory_mb=4096, free_memory_mb=4096, slices={"cpu": 2},
                      free_slices={"cpu": 1}, disk_bps=1e9, net_bps=1e9, contracts=(AFFINE,),
                      warm=(Warm(id="i-1", model=AFFINE.key, in_flight=0, max_concurrency=4),))
    return ClusterView(version=1, nodes=(b,), contracts=(AFFINE,), origin_bps=1e8, service_s=0.05, token="unused")


@dataclass
class Cluster:
    a: str
    b: str
    node_b: NodeB
    keys: KeyFile
    pki: Path

    def client(self, cert: str | None = None) -> httpx.Client:
        """A client trusting the cluster CA; with `cert`, presenting that node's certificate."""
        ctx = (NodeTls.of(self.pki / "nodes" / cert).client_context() if cert
               else ssl.create_default_context(cafile=str(self.pki / "ca.crt")))
        if cert is None:
            ctx.check_hostname = False   # the node certificates name 127.0.0.1 all the same
        return httpx.Client(verify=ctx, timeout=10)


def _gateway(app: Any, node_dir: Path) -> ThreadedServer:
    return ThreadedServer(app, log_level="critical", http=guarded_protocol(10, 100),
                          **NodeTls.of(node_dir).server_kwargs())


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    pki = tmp_path / "pki"
    init_ca(pki)
    for node in ("a", "b"):
        issue(pki, node, ["127.0.0.1"])
    keys = KeyFile(tmp_path / "cluster-keys.json")   # the cluster's store (PostgreSQL: tests/integration/jobs)
    ring_a, ring_b = SharedKeyRing(keys, "a", REFRESH_S), SharedKeyRing(keys, "b", REFRESH_S)
    node_b = NodeB(FakeService(models=[AFFINE]))
    app_b = create_app(node_b.fake, Metrics(), auth=Auth(ring_b, RateLimiter(RateLimit(0.5, 2))))
    app_b.router.routes.extend(cluster_routes(node_b, nodes_only=True))
    (tmp_path / "models").mkdir()
    world = World(tmp_path)
    with _gateway(app_b, pki / "nodes" / "b") as b:
        forwarder = Forwarder(5.0, NodeTls.of(pki / "nodes" / "a").client_context())
        service = ClusterService(world.ctl, NoController(), forwarder, ClusterSettings(node_id="a", url="x"))
        service._set_view(view_with_b(b.url))
        with _gateway(create_app(service, Metrics(), auth=Auth(ring_a)), pki / "nodes" / "a") as a:
            yield Cluster(a.url, b.url, node_b, keys, pki)
        asyncio.run(forwarder.close())
    ring_a.close()
    ring_b.close()


def _infer(client: httpx.Client, url: str, key: str, **headers: str) -> httpx.Response:
    return client.post(f"{url}/v2/models/affine/infer", json=BODY,
                       headers={"authorization": f"Bearer {key}", **headers})


def _until(predicate: Any, timeout_s: float = 5.0) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "not within the time allowed"
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_forwarded_request_carries_the_callers_key_tenant_and_trace_over_mutual_tls(cluster: Cluster) -> None:
    _, key = cluster.keys.create("acme", "user")
    with cluster.client() as client:
        _until(lambda: _infer(client, cluster.a, key).status_code != 401)   # both nodes have read the new key
        cluster.node_b.seen.clear()
        reply = _infer(client, cluster.a, key, traceparent=TRACE)
    assert reply.status_code == 200, reply.text
    assert reply.json()["outputs"][0]["data"] == [3.0, 5.0, 7.0]
    [seen] = cluster.node_b.seen
    assert seen["tenant"] == "acme" and seen["x-ember-tenant"] == "acme"
    assert seen["authorization"] == f"Bearer {key}" and seen["traceparent"] == TRACE


def test_the_cluster_routes_take_only_a_node_of_the_cluster(cluster: Cluster, tmp_path: Path) -> None:
    _, key = cluster.keys.create("acme", "user")
    body, url = bundle.pack({"x": np.array([[1, 2, 3]], np.float32)}), f"{cluster.b}/cluster/infer/affine/1"
    headers = {"authorization": f"Bearer {key}", "content-type": "application/octet-stream"}
    with cluster.client("a") as node:
        _until(lambda: node.post(url, content=body, headers=headers).status_code == 200)
    with cluster.client() as client:   # a client with a valid key, but no node certificate
        refused = client.post(url, content=body, headers=headers)
    assert refused.status_code == 403 and "node certificate" in refused.json()["message"]
    rogue = tmp_path / "rogue"
    init_ca(rogue)
    issue(rogue, "a", ["127.0.0.1"])   # the same name, another CA
    ctx = NodeTls.of(rogue / "nodes" / "a").client_context()
    ctx.load_verify_locations(cafile=str(cluster.pki / "ca.crt"))   # it trusts B; B does not trust it
    with httpx.Client(verify=ctx, timeout=10) as client, pytest.raises(httpx.HTTPError):
        client.post(url, content=body, headers=headers).raise_for_status()


def test_the_serving_node_checks_the_key_and_tenant_itself(cluster: Cluster) -> None:
    record, key = cluster.keys.create("acme", "user")
    _, other = cluster.keys.create("other", "user")
    body, url = bundle.pack({"x": np.array([[1, 2, 3]], np.float32)}), f"{cluster.b}/cluster/infer/affine/1"

    def post(key: str | None, **extra: str) -> httpx.Response:
        auth = {} if key is None else {"authorization": f"Bearer {key}"}
        with cluster.client("a") as node:   # what node A sends, with a caller's headers
            return node.post(url, content=body, headers={**auth, "content-type": "application/octet-stream", **extra})

    _until(lambda: post(key).status_code == 200)
    assert post(key, **{"x-ember-tenant": "other"}).status_code == 403     # not the key's tenant
    assert post(other).status_code == 404                                  # not a model tenant "other" sees
    assert post("ember_000000000000_" + "x" * 43).status_code == 401       # no such key
    assert post(None).status_code == 401                                   # no key at all
    cluster.keys.revoke(record.id)
    _until(lambda: post(key).status_code == 401, timeout_s=5)              # revoked: refused by B itself


def test_the_serving_nodes_rate_limit_applies_to_forwarded_requests(cluster: Cluster) -> None:
    """B's bucket (burst 2, 0.5/s); A has none: the third request forwarded at once is B's 429."""
    _, key = cluster.keys.create("acme", "user")
    with cluster.client() as client:
        _until(lambda: _infer(client, cluster.a, key).status_code != 401)   # spends one of B's two
        statuses = [_infer(client, cluster.a, key).status_code for _ in range(3)]
    assert statuses[-1] == 429 and statuses.count(429) >= 2, statuses
