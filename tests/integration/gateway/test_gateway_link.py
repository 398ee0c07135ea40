"""A gateway's port takes gateway links beside HTTP (ember/gateway/connections.py, link_server.py): a real uvicorn
with the gateway's own protocol, a gateway app with its cluster routes over a FakeService, and raw sockets or the
forwarder's LinkClient. A forwarded request on a link is answered as over HTTP; another path is a 404 and a
malformed head a 400, the link kept; an oversized or stalled frame drops that link (only it); an idle link is
closed at the keep-alive; on a TLS gateway only a connection with a node certificate becomes a link. A request's head
is checked before its body is read: without a valid key (keys on) it is answered 401 at once, and its body holds a
share of the gateway's in-flight budget from then on (none left: 429)."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from ember.cluster.ca import init_ca, issue
from ember.cluster.delivery import Answer
from ember.cluster.link_client import LinkClient
from ember.core.access import Principal
from ember.gateway.app import create_app
from ember.gateway.auth import Auth
from ember.gateway.cluster_api import cluster_routes
from ember.gateway.connections import guarded_protocol
from ember.metrics import Metrics
from ember.serving.results import InferResult, JobAccepted
from ember.testing.asgi import ThreadedServer
from ember.testing.service import FakeService, fake_contracts
from ember.tls import NodeTls
from ember.wire import bundle
from ember.wire import link_frames as lf
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

AFFINE = next(c for c in fake_contracts() if c.name == "affine")
PATH = "/cluster/infer/affine/1"
BODY = bundle.pack({"x": np.array([[1, 2, 3]], np.float32)})
MAX_BODY = 4096
STALL_S, KEEPALIVE_S = 0.5, 1.5


class Host:
    """The serving side of cluster_routes: the fake service's answer."""

    def __init__(self) -> None:
        self.fake = FakeService(models=[AFFINE])

    async def serve_forwarded(self, contract: ModelContract, inputs: Tensors,
                              tenant: str | None) -> InferResult | JobAccepted:
        return await self.fake.infer(contract, inputs, tenant=tenant)

    async def serve_stream(self, contract: ModelContract, inputs: Tensors, tenant: str | None = None) -> Any:
        return await self.fake.stream(contract, inputs)


class Keys:
    """One valid API key."""

    def authenticate(self, key: str) -> Principal | None:
        return Principal("acme", "user") if key == "good" else None


def serving(*, auth: Auth | None = None, max_inflight: int = MAX_BODY * 4, **uvicorn: Any) -> ThreadedServer:
    host = Host()
    app = create_app(host.fake, Metrics(), max_body_bytes=MAX_BODY, max_inflight_bytes=max_inflight, auth=auth)
    app.router.routes.extend(cluster_routes(host))
    return ThreadedServer(app, http=guarded_protocol(STALL_S, 100, MAX_BODY), timeout_keep_alive=KEEPALIVE_S,
                          **uvicorn)


@pytest.fixture
def gateway() -> Iterator[ThreadedServer]:
    with serving() as server:
        yield server


def request(path: str = PATH, body: bytes = BODY, key: str | None = None) -> bytes:
    headers = (("content-type", "application/octet-stream"), *((("authorization", f"Bearer {key}"),) if key else ()))
    return lf.LinkRequest("POST", path, headers, body).encode()


def head_of(frame: bytes) -> bytes:
    """A request frame without its body: its head and meta."""
    meta_n, _body_n = lf.REQUEST_HEAD.unpack(frame[:lf.REQUEST_HEAD.size])
    return frame[:lf.REQUEST_HEAD.size + meta_n]


def read_answer(sock: socket.socket) -> lf.LinkResponse:
    head = read_exactly(sock, lf.RESPONSE_HEAD.size)
    status, meta_n, body_n = lf.response_sizes(head, 1 << 20)
    rest = read_exactly(sock, meta_n + body_n)
    return lf.LinkResponse(status, lf.response_meta(rest[:meta_n]), rest[meta_n:])


def read_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        part = sock.recv(n - len(out))
        assert part, f"the link was closed after {len(out)} of {n} bytes"
        out += part
    return out


def closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closed `sock` (nothing read meanwhile); fails past `seconds`."""
    start = time.monotonic()
    sock.settimeout(seconds)
    assert sock.recv(1) == b""
    return time.monotonic() - start


def link(server: ThreadedServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(lf.PREFACE)
    return sock


def exchange(url: str, tls: ssl.SSLContext | None = None) -> Answer:
    async def main() -> Answer:
        client = LinkClient(tls)
        try:
            return await client.exchange(url, "POST", PATH, {"content-type": "application/octet-stream"}, BODY)
        finally:
            client.close()

    return asyncio.run(main())


def test_a_forwarded_request_on_a_link_is_answered_as_over_http(gateway: ThreadedServer) -> None:
    over_http = httpx.post(gateway.url + PATH, content=BODY, headers={"content-type": "application/octet-stream"})
    answer = exchange(gateway.url)
    assert answer.status == over_http.status_code == 200
    assert answer.body == over_http.content
    assert bundle.unpack(answer.body, "answer")["y"].tolist() == [[3, 5, 7]]
    assert answer.header("x-ember-rung") == over_http.headers["x-ember-rung"]


def test_requests_written_together_are_answered_in_order_and_the_link_kept(gateway: ThreadedServer) -> None:
    bad_meta = lf.REQUEST_HEAD.pack(3, 0) + b"{{{"
    with link(gateway) as sock:
        sock.sendall(request() + request(path="/v2/models/affine/infer") + request(path="/cluster/infer/nope/1")
                     + bad_meta + request(body=b"\x00" * 10) + request())
        answers = [read_answer(sock) for _ in range(6)]
    assert [a.status for a in answers] == [200, 404, 404, 400, 400, 200]
    assert "carries only POST /cluster/infer/" in json.loads(answers[1].body)["message"]
    assert json.loads(answers[3].body) == {"kind": "InvalidInput", "message": "link: request meta is not JSON",
                                           "retry_after": None}


def test_http_still_served_on_the_port_even_a_byte_at_a_time(gateway: ThreadedServer) -> None:
    raw = (f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
           f"Content-Length: {len(BODY)}\r\nConnection: close\r\n\r\n").encode() + BODY
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(len(raw)):
            sock.sendall(raw[i:i + 1])
        sock.settimeout(5)
        reply = b""
        while part := sock.recv(65536):
            reply += part
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and bundle.unpack(body, "answer")["y"].tolist() == [[3, 5, 7]]


@pytest.mark.parametrize("bad", [
    lf.REQUEST_HEAD.pack(10, MAX_BODY + 1),                    # a body past the gateway's max_body_bytes
    lf.REQUEST_HEAD.pack(lf.MAX_META + 1, 0),                  # meta past its bound
], ids=["body-past-max", "meta-past-max"])
def test_an_oversized_frame_drops_that_link_only(gateway: ThreadedServer, bad: bytes) -> None:
    with link(gateway) as sock, link(gateway) as other:
        sock.sendall(bad)
        assert closed_within(sock, 5) < 1
        other.sendall(request())
        assert read_answer(other).status == 200


def test_a_frame_begun_and_stalled_is_closed_and_an_idle_link_at_the_keepalive(gateway: ThreadedServer) -> None:
    with link(gateway) as stalled, link(gateway) as idle:
        stalled.sendall(request()[:20])
        idle.sendall(request())
        assert read_answer(idle).status == 200
        assert STALL_S * 0.8 < closed_within(stalled, 5) < KEEPALIVE_S
        assert closed_within(idle, 5) < KEEPALIVE_S + 0.5


def test_on_a_tls_gateway_only_a_node_certificate_opens_a_link(tmp_path: Path) -> None:
    init_ca(tmp_path / "pki")
    for node in ("a", "b"):
        issue(tmp_path / "pki", node, ["127.0.0.1"])
    with serving(**NodeTls.of(tmp_path / "pki" / "nodes" / "b").server_kwargs()) as server:
        answer = exchange(server.url, NodeTls.of(tmp_path / "pki" / "nodes" / "a").client_context())
        assert answer.status == 200
        anonymous = ssl.create_default_context(cafile=str(tmp_path / "pki" / "nodes" / "a" / "ca.crt"))
        anonymous.check_hostname = False
        with (socket.create_connection(("127.0.0.1", server.port)) as raw,
              anonymous.wrap_socket(raw) as sock):
            sock.sendall(lf.PREFACE + request())
            sock.settimeout(5)
            reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 400"), reply[:60]   # read as HTTP, which it is not


@pytest.mark.parametrize("key", [None, "bad"], ids=["no-key", "unknown-key"])
def test_a_request_without_a_valid_key_is_refused_before_its_body_is_read(key: str | None) -> None:
    with serving(auth=Auth(Keys())) as server, link(server) as sock:
        refused = request(key=key)
        sock.sendall(head_of(refused))   # the body not sent: the answer cannot wait for it
        sock.settimeout(5)
        answer = read_answer(sock)
        assert answer.status == 401 and "before its body is read" in json.loads(answer.body)["message"]
        sock.sendall(refused[len(head_of(refused)):] + request(key="good"))   # read past; the link kept in step
        kept = read_answer(sock)
        assert kept.status == 200 and bundle.unpack(kept.body, "answer")["y"].tolist() == [[3, 5, 7]]


def test_link_bodies_hold_the_in_flight_budget_and_one_past_it_is_refused_429() -> None:
    big = bundle.pack({"x": np.zeros((MAX_BODY // 16, 3), np.float32)})   # most of MAX_BODY
    assert MAX_BODY // 2 < len(big) <= MAX_BODY
    with serving(max_inflight=MAX_BODY) as server, link(server) as first, link(server) as second:
        holding = request(body=big)
        first.sendall(head_of(holding))   # its body claimed whole from the head, before a byte of it came
        second.settimeout(5)
        for _ in range(100):   # until the server has read the first head (the two together are past the budget)
            second.sendall(request(body=big))
            over = read_answer(second)
            if over.status != 200:
                break
            time.sleep(0.02)
        assert over.status == 429 and over.header("retry-after") == "1"
        assert "max_inflight_mb" in json.loads(over.body)["message"]
        first.sendall(holding[len(head_of(holding)):])
        first.settimeout(5)
        assert read_answer(first).status == 200   # answered: its claim given back
        second.sendall(request(body=big))
        assert read_answer(second).status == 200
