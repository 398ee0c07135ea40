"""A gateway's port takes gateway links beside HTTP (ember/gateway/connections.py, link_server.py): a real uvicorn
with the gateway's own protocol, a gateway app over a FakeService, and raw sockets or the forwarder's LinkClient.
A request on a link is answered as the same request over HTTP is; a malformed, oversized or stalled frame drops
that link (and only it); an idle link is closed at the keep-alive."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from ember.cluster.link_client import LinkClient
from ember.gateway.app import create_app
from ember.gateway.connections import guarded_protocol
from ember.metrics import Metrics
from ember.testing.asgi import ThreadedServer
from ember.testing.service import FakeService
from ember.wire import link_frames as lf

BODY = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}).encode()
PATH = "/v2/models/affine/infer"
MAX_BODY = 4096
STALL_S, KEEPALIVE_S = 0.5, 1.5


@pytest.fixture
def gateway() -> Iterator[ThreadedServer]:
    app = create_app(FakeService(), Metrics(), max_body_bytes=MAX_BODY)
    with ThreadedServer(app, http=guarded_protocol(STALL_S, 100, MAX_BODY), timeout_keep_alive=KEEPALIVE_S) as server:
        yield server


def request(path: str = PATH, body: bytes = BODY, **headers: str) -> bytes:
    return lf.LinkRequest("POST", path, (("content-type", "application/json"), *headers.items()), body).encode()


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


def test_a_request_on_a_link_is_answered_as_over_http(gateway: ThreadedServer) -> None:
    over_http = httpx.post(gateway.url + PATH, content=BODY, headers={"content-type": "application/json"})

    async def over_link() -> lf.LinkResponse:
        client = LinkClient()
        try:
            return await client.exchange(gateway.url, "POST", PATH, {"content-type": "application/json"}, BODY)
        finally:
            client.close()

    answer = asyncio.run(over_link())
    assert answer.status == over_http.status_code == 200
    assert json.loads(answer.body)["outputs"] == over_http.json()["outputs"]
    assert answer.header("content-type") == over_http.headers["content-type"]


def test_requests_written_together_are_answered_in_order_and_errors_are_the_apps(gateway: ThreadedServer) -> None:
    with link(gateway) as sock:
        sock.sendall(request() + request(path="/v2/models/nope/infer") + request(body=b"{"))
        answers = [read_answer(sock) for _ in range(3)]
    assert [a.status for a in answers] == [200, 404, 400]
    assert "nope" in json.loads(answers[1].body)["error"]


def test_http_still_served_on_the_port_even_a_byte_at_a_time(gateway: ThreadedServer) -> None:
    raw = (f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(BODY)}\r\n"
           f"Connection: close\r\n\r\n").encode() + BODY
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(len(raw)):
            sock.sendall(raw[i:i + 1])
        sock.settimeout(5)
        reply = b""
        while part := sock.recv(65536):
            reply += part
    assert reply.startswith(b"HTTP/1.1 200 OK") and b'"outputs"' in reply


@pytest.mark.parametrize("bad", [
    lf.REQUEST_HEAD.pack(3, 0) + b"{{{",                       # meta not JSON
    lf.REQUEST_HEAD.pack(10, MAX_BODY + 1),                    # a body past the gateway's max_body_bytes
    lf.REQUEST_HEAD.pack(lf.MAX_META + 1, 0),                  # meta past its bound
], ids=["meta-not-json", "body-past-max", "meta-past-max"])
def test_a_malformed_or_oversized_frame_drops_that_link_only(gateway: ThreadedServer, bad: bytes) -> None:
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
