"""Whether a forwarded request may go to another node: only if it never reached the first (no connection made), or
its contract says `idempotent: true`. Node A's ClusterService forwards over real aiohttp (`Forwarder`) to peers on
loopback: a real gateway that serves (`good`), a port nothing listens on (`refused`), a server that reads the
request and hangs up (`hangs_up`: the request was delivered, its reply lost), and one that reads it and never
answers (`silent`: a machine fallen off the network). No Ray: A's view is set by the test, the peer that fails
holding the least loaded warm instance, so it is tried first."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("aiohttp")

from ember.cluster.forward import Forwarder
from ember.cluster.service import ClusterService, ClusterSettings
from ember.core.placement import Placement
from ember.errors import NodeUnreachable
from ember.gateway.app import create_app
from ember.gateway.cluster_api import cluster_routes
from ember.metrics import Metrics
from ember.serving.results import InferResult, InferStream, JobAccepted
from ember.testing.asgi import ThreadedServer
from ember.testing.controller import World
from ember.testing.service import FakeService, fake_contracts
from ember.wire.cluster import ClusterView, NodeInventory, Warm
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

AFFINE = next(c for c in fake_contracts() if c.name == "affine")
BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}


@dataclass
class Good:
    fake: FakeService
    served: int = 0

    async def serve_forwarded(self, contract: ModelContract, inputs: Tensors,
                              tenant: str | None) -> InferResult | JobAccepted:
        self.served += 1
        return await self.fake.infer(contract, inputs, tenant=tenant)

    async def serve_stream(self, contract: ModelContract, inputs: Tensors) -> InferStream:
        return await self.fake.stream(contract, inputs)


@dataclass
class BadPeer:
    """A TCP server on loopback that reads each request; then hangs up (`answer=False`), or holds it forever."""

    hang_up: bool
    received: list[bytes] = field(default_factory=list)
    got: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.settimeout(0.3)
            data = b""
            try:
                while chunk := conn.recv(65536):
                    data += chunk
            except TimeoutError:
                pass
            self.received.append(data)
            self.got.set()
            if self.hang_up:
                conn.close()
            else:
                self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def refused_url() -> str:
    with socket.create_server(("127.0.0.1", 0)) as s:   # a port that was free, and nothing listens on now
        return f"http://127.0.0.1:{s.getsockname()[1]}"


class NoController:
    async def report(self, inventory: NodeInventory) -> ClusterView:
        raise ConnectionError("no controller in this test")

    async def place(self, model: str, avoid: tuple[str, ...], here: str | None = None) -> Placement:
        raise ConnectionError("no controller in this test")

    def placed(self, placement: Any) -> None:
        pass


def view(nodes: dict[str, tuple[str, int]], contract: ModelContract) -> ClusterView:
    """`nodes`: id -> (gateway URL, requests in flight on its warm instance of `contract`, of 4)."""
    return ClusterView(version=1, contracts=(contract,), origin_bps=1e8, service_s=0.05, token="unused", nodes=tuple(
        NodeInventory(node=node, url=url, memory_mb=4096, free_memory_mb=4096, slices={"cpu": 2},
                      free_slices={"cpu": 1}, disk_bps=1e9, net_bps=1e9, contracts=(contract,),
                      warm=(Warm(id=f"i-{node}", model=contract.key, in_flight=busy, max_concurrency=4),))
        for node, (url, busy) in nodes.items()))


@pytest.fixture
def good() -> Iterator[tuple[Good, str]]:
    host = Good(FakeService(models=[AFFINE]))
    app = create_app(host.fake, Metrics())
    app.router.routes.extend(cluster_routes(host))
    with ThreadedServer(app, log_level="critical") as server:
        yield host, server.url


def gateway_a(tmp: Path, first: str, good_url: str, contract: ModelContract) -> tuple[ClusterService, Any]:
    (tmp / "models").mkdir(exist_ok=True)
    service = ClusterService(World(tmp).ctl, NoController(), Forwarder(5.0), ClusterSettings(node_id="a", url="x"))
    service._set_view(view({"first": (first, 0), "good": (good_url, 3)}, contract))
    return service, ThreadedServer(create_app(service, Metrics()), log_level="critical")


def infer_through(tmp: Path, first: str, good_url: str,
                  contract: ModelContract) -> tuple[httpx.Response, ClusterService]:
    service, server = gateway_a(tmp, first, good_url, contract)
    with server:
        reply = httpx.post(f"{server.url}/v2/models/affine/infer", json=BODY, timeout=15)
    asyncio.run(service.close())
    return reply, service


@pytest.mark.parametrize("idempotent", [False, True])
def test_a_request_that_never_reached_its_node_goes_to_another(tmp_path: Path, good: tuple[Good, str],
                                                               idempotent: bool) -> None:
    host, url = good
    reply, service = infer_through(tmp_path, refused_url(), url, AFFINE.model_copy(update={"idempotent": idempotent}))
    assert reply.status_code == 200, reply.text
    assert reply.json()["outputs"][0]["data"] == [3.0, 5.0, 7.0]
    assert host.served == 1 and service.retried == 1 and service.lost == 0


def test_a_request_whose_node_took_it_and_hung_up_is_not_run_again_elsewhere(tmp_path: Path,
                                                                             good: tuple[Good, str]) -> None:
    host, url = good
    peer = BadPeer(hang_up=True)
    try:
        reply, service = infer_through(tmp_path, peer.url, url, AFFINE)
    finally:
        peer.close()
    assert reply.status_code == 502, reply.text
    assert "not run again on another node" in reply.text and "not idempotent" in reply.text, reply.text
    assert b"POST /cluster/infer/affine/1" in peer.received[0]      # it was delivered
    assert host.served == 0 and service.lost == 1 and service.retried == 0
    assert service._view is not None and [n.node for n in service._view.nodes] == ["good"]   # it left A's view


def test_an_idempotent_model_is_run_again_elsewhere_when_its_reply_was_lost(tmp_path: Path,
                                                                           good: tuple[Good, str]) -> None:
    host, url = good
    peer = BadPeer(hang_up=True)
    try:
        reply, service = infer_through(tmp_path, peer.url, url, AFFINE.model_copy(update={"idempotent": True}))
    finally:
        peer.close()
    assert reply.status_code == 200, reply.text
    assert peer.received and host.served == 1 and service.retried == 1 and service.lost == 0


def test_a_request_waiting_on_a_node_that_leaves_the_view_ends_at_once(tmp_path: Path,
                                                                       good: tuple[Good, str]) -> None:
    """A machine fallen silent resets nothing: the request would wait for its whole timeout; the view's next
    answer without the node ends it (NodeUnreachable, not run again: the node had it)."""
    _, url = good
    peer = BadPeer(hang_up=False)
    (tmp_path / "models").mkdir()
    service = ClusterService(World(tmp_path).ctl, NoController(), Forwarder(30.0), ClusterSettings("a", "x"))
    service._set_view(view({"silent": (peer.url, 0), "good": (url, 3)}, AFFINE))
    inputs = {"x": np.array([[1, 2, 3]], np.float32)}

    async def scenario() -> BaseException | None:
        task = asyncio.create_task(service.infer(AFFINE, inputs))
        while not peer.got.is_set():
            await asyncio.sleep(0.01)
        service._set_view(view({"good": (url, 3)}, AFFINE))    # the controller's next view: the node is gone
        try:
            await asyncio.wait_for(task, 2.0)
        except NodeUnreachable as err:
            return err
        finally:
            await service.close()
        return None

    try:
        err = asyncio.run(scenario())
    finally:
        peer.close()
    assert isinstance(err, NodeUnreachable), err
    assert "left the cluster's view" in err.message and "not idempotent" in err.message
