"""Whether a forwarded request may go to another node: only if it never reached the first (no connection made), or
its contract says `idempotent: true`. Node A's ClusterService forwards over real aiohttp (`Forwarder`) to peers on
loopback: a real gateway that serves (`good`), a port nothing listens on (`refused`), a server that reads the
request and hangs up (`hangs_up`: the request was delivered, its reply lost: a clean close, FIN), one that closes
with the request unread in its socket (its kernel resets the connection, RST: a process that died before reading
it, never delivered), and one that reads it and never answers (`silent`: a machine fallen off the network). No
Ray: A's view is set by the test, the peer that fails holding the least loaded warm instance, so it is tried
first. Last, a kept-alive connection its peer closed while it lay in the pool is not written to."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
import threading
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
from ember.core.states import Rung
from ember.errors import NodeUnreachable
from ember.gateway.app import create_app
from ember.gateway.cluster_api import cluster_routes
from ember.metrics import Metrics
from ember.serving.results import InferResult, InferStream, JobAccepted
from ember.testing.asgi import ThreadedServer
from ember.testing.controller import World
from ember.testing.service import FakeService, fake_contracts
from ember.tls import NodeTls
from ember.wire import bundle
from ember.wire.cluster import ClusterView, NodeInventory, Warm
from ember.wire.contract import ModelContract
from ember.wire.link_frames import PREFACE, LinkResponse
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

    async def serve_stream(self, contract: ModelContract, inputs: Tensors, tenant: str | None = None) -> InferStream:
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


class ResetPeer:
    """A TCP server on loopback that takes each connection and, once `n` requests wait in their sockets unread, closes
    them without reading a byte, one at a time (`release`): each closed with data unread, so its kernel answers
    with a reset (RST), as a node's does for a process killed before it read its request."""

    def __init__(self, n: int = 1, release: Any = None) -> None:
        self.n, self.release = n, release
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.seen: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conns = []
        while len(conns) < self.n:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            select.select([conn], [], [])
            self.seen.append(conn.recv(64, socket.MSG_PEEK))   # there, and left unread
            conns.append(conn)
        for k, conn in enumerate(conns):
            if k and self.release is not None:
                self.release()
            conn.close()

    def close(self) -> None:
        self.sock.close()


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


def gateway_a(tmp: Path, first: str, good_url: str, contract: ModelContract,
              link: bool = True) -> tuple[ClusterService, Any]:
    (tmp / "models").mkdir(exist_ok=True)
    service = ClusterService(World(tmp).ctl, NoController(), Forwarder(5.0, link=link),
                             ClusterSettings(node_id="a", url="x"))
    service._set_view(view({"first": (first, 0), "good": (good_url, 3)}, contract))
    return service, ThreadedServer(create_app(service, Metrics()), log_level="critical")


def infer_through(tmp: Path, first: str, good_url: str, contract: ModelContract,
                  link: bool = True) -> tuple[httpx.Response, ClusterService]:
    service, server = gateway_a(tmp, first, good_url, contract, link)
    with server:
        reply = httpx.post(f"{server.url}/v2/models/affine/infer", json=BODY, timeout=15)
    asyncio.run(service.close())
    return reply, service


# The delivery rule is one (ember.cluster.delivery), whichever transport a unary request takes: a gateway link (the
# default) or HTTP (`--gateway-links off`).
TRANSPORTS = pytest.mark.parametrize("link", [True, False], ids=["link", "http"])


@TRANSPORTS
@pytest.mark.parametrize("idempotent", [False, True])
def test_a_request_that_never_reached_its_node_goes_to_another(tmp_path: Path, good: tuple[Good, str],
                                                               idempotent: bool, link: bool) -> None:
    host, url = good
    reply, service = infer_through(tmp_path, refused_url(), url, AFFINE.model_copy(update={"idempotent": idempotent}),
                                   link)
    assert reply.status_code == 200, reply.text
    assert reply.json()["outputs"][0]["data"] == [3.0, 5.0, 7.0]
    assert host.served == 1 and service.retried == 1 and service.lost == 0


@TRANSPORTS
def test_a_request_whose_node_took_it_and_hung_up_is_not_run_again_elsewhere(tmp_path: Path, good: tuple[Good, str],
                                                                             link: bool) -> None:
    host, url = good
    peer = BadPeer(hang_up=True)
    try:
        reply, service = infer_through(tmp_path, peer.url, url, AFFINE, link)
    finally:
        peer.close()
    assert reply.status_code == 502, reply.text
    assert "not run again on another node" in reply.text and "not idempotent" in reply.text, reply.text
    assert b"/cluster/infer/affine/1" in peer.received[0]      # it was delivered
    assert host.served == 0 and service.lost == 1 and service.retried == 0
    assert service._view is not None and [n.node for n in service._view.nodes] == ["good"]   # it left A's view


@TRANSPORTS
def test_a_request_its_node_reset_unread_is_sent_to_another(tmp_path: Path, good: tuple[Good, str],
                                                            link: bool) -> None:
    """A reset before any reply: the peer's process never read the request (it died first, or was gone when it
    came): not delivered, so sent elsewhere though the model is not idempotent."""
    host, url = good
    peer = ResetPeer()
    try:
        reply, service = infer_through(tmp_path, peer.url, url, AFFINE, link)
    finally:
        peer.close()
    assert reply.status_code == 200, reply.text
    sent = (PREFACE, b'"path":"/cluster/infer') if link else (b"POST ", b"/cluster/infer/affine/1")
    assert peer.seen[0].startswith(sent[0]) and sent[1] in peer.seen[0]   # in its socket, unread
    assert host.served == 1 and service.retried == 1 and service.lost == 0


def test_requests_waiting_on_a_node_that_reset_one_end_on_their_own_answers(tmp_path: Path,
                                                                            good: tuple[Good, str]) -> None:
    """Two requests wait unread on a node whose process died: the first reset drops the node from A's view, and
    the second, reset after that, is still told apart (not cut as 'left the view'): both go elsewhere."""
    _, url = good
    (tmp_path / "models").mkdir()
    service = ClusterService(World(tmp_path).ctl, NoController(), Forwarder(30.0), ClusterSettings("a", "x"))

    def dropped() -> None:   # the second is closed once A has dropped the node after the first
        while service._view is not None and any(n.node == "dead" for n in service._view.nodes):
            threading.Event().wait(0.005)

    peer = ResetPeer(n=2, release=dropped)
    service._set_view(view({"dead": (peer.url, 0), "good": (url, 2)}, AFFINE))
    inputs = {"x": np.array([[1, 2, 3]], np.float32)}

    async def scenario() -> list[InferResult | JobAccepted | BaseException]:
        try:
            calls = [service.infer(AFFINE, inputs) for _ in range(2)]
            return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
        finally:
            await service.close()

    try:
        results = asyncio.run(scenario())
    finally:
        peer.close()
    assert len(peer.seen) == 2
    assert all(isinstance(r, InferResult) for r in results), results
    assert service.retried == 2 and service.lost == 0


def _tls_pair(tmp: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context (node b's certificate) and a client one (node a's), of one cluster CA."""
    init_ca(tmp / "pki")
    for node in ("a", "b"):
        issue(tmp / "pki", node, ["127.0.0.1"])
    b = NodeTls.of(tmp / "pki" / "nodes" / "b")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(str(b.cert), str(b.key))
    server.load_verify_locations(cafile=str(b.ca))
    server.verify_mode = ssl.CERT_OPTIONAL
    return server, NodeTls.of(tmp / "pki" / "nodes" / "a").client_context()


@pytest.mark.parametrize(("tls", "link"), [(False, True), (True, True), (False, False), (True, False)])
def test_a_kept_alive_connection_its_peer_closed_in_the_pool_is_not_used(tmp_path: Path, tls: bool,
                                                                         link: bool) -> None:
    """The peer answers and closes the connection (its FIN arrives while A's event loop is busy, unread): the next
    request takes a new connection, not that one (written to it, it would end as a clean close: taken or not,
    A could not tell). Over TLS the peer's close alert comes before its FIN: data waiting, and still closed. On a
    gateway link and over HTTP (`Forwarder(link=False)`, as streams go)."""
    body = bundle.pack({"y": np.array([[3, 5, 7]], np.float32)})
    headers = (("content-type", "application/octet-stream"), ("x-ember-rung", "hot"), ("x-ember-instance", "i-1"))
    answer = LinkResponse(200, headers, body).encode() if link else (
        "HTTP/1.1 200 OK\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) +
        f"content-length: {len(body)}\r\n\r\n").encode() + body
    server = socket.create_server(("127.0.0.1", 0))
    url = f"{'https' if tls else 'http'}://127.0.0.1:{server.getsockname()[1]}"
    server_tls, client_tls = _tls_pair(tmp_path) if tls else (None, None)
    close_now, closed, requests = threading.Event(), threading.Event(), []

    def close(conn: socket.socket) -> None:
        if isinstance(conn, ssl.SSLSocket):
            conn.settimeout(0.5)
            with contextlib.suppress(OSError):   # sends its close alert, then waits for A's, which does not come
                conn = conn.unwrap()
        conn.close()

    def serve() -> None:
        for _ in range(2):
            conn, _ = server.accept()
            if server_tls is not None:
                conn = server_tls.wrap_socket(conn, server_side=True)
            requests.append(conn.recv(65536))
            conn.sendall(answer)
            close_now.wait()
            close(conn)
            closed.set()

    threading.Thread(target=serve, daemon=True).start()
    inputs = {"x": np.array([[1, 2, 3]], np.float32)}

    async def scenario() -> tuple[InferResult | JobAccepted, InferResult | JobAccepted]:
        forwarder = Forwarder(5.0, client_tls, link=link)
        try:
            first = await forwarder.infer(url, AFFINE, inputs, {})
            close_now.set()
            closed.wait(5)   # blocking: the event loop does not run, so it has not read the FIN
            return first, await forwarder.infer(url, AFFINE, inputs, {})
        finally:
            await forwarder.close()

    try:
        first, second = asyncio.run(scenario())
    finally:
        server.close()
    assert isinstance(first, InferResult) and isinstance(second, InferResult)
    assert second.rung is Rung.HOT and len(requests) == 2   # two connections, each with one request


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


@dataclass
class Slow(Good):
    """A gateway whose model takes `delay_s` to answer."""

    delay_s: float = 1.0

    async def serve_forwarded(self, contract: ModelContract, inputs: Tensors,
                              tenant: str | None) -> InferResult | JobAccepted:
        await asyncio.sleep(self.delay_s)
        return await super().serve_forwarded(contract, inputs, tenant)


def test_a_forwarded_request_waits_as_long_as_its_models_own_timeout_not_the_servers() -> None:
    """A model whose `limits.request_timeout_s` exceeds the server's (an LLM's 300 s) is not cut at the server's."""
    host = Slow(FakeService(models=[AFFINE]), delay_s=1.0)
    app = create_app(host.fake, Metrics())
    app.router.routes.extend(cluster_routes(host))
    patient = AFFINE.model_copy(update={"limits": AFFINE.limits.model_copy(update={"request_timeout_s": 5.0})})
    inputs = {"x": np.array([[1, 2, 3]], np.float32)}

    async def scenario(url: str) -> tuple[InferResult | JobAccepted, BaseException | None]:
        forwarder = Forwarder(0.3, answer_margin_s=0.2)   # the server's 0.3 s + 0.2: cut at 0.5 s
        try:
            served = await forwarder.infer(url, patient, inputs, {})
            try:
                await forwarder.infer(url, AFFINE, inputs, {})
            except NodeUnreachable as err:
                return served, err
            return served, None
        finally:
            await forwarder.close()

    with ThreadedServer(app, log_level="critical") as server:
        served, cut = asyncio.run(scenario(server.url))
    assert isinstance(served, InferResult)
    assert isinstance(cut, NodeUnreachable) and "did not answer" in str(cut)
