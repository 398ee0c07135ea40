"""A gateway link's flow control (ember/gateway/link_server.py), on a transport fake: a peer that stops reading its
answers gets no more of its requests read (or run) until it reads again; a request's body holds its share of the
gateway's in-flight budget from its head on, and a refused one is read past, none of it kept."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ember.gateway.app import create_app
from ember.gateway.link_server import LinkProtocol, gate_of
from ember.metrics import Metrics
from ember.testing.service import FakeService
from ember.wire import link_frames as lf


@dataclass
class FakeTransport:
    written: list[bytes] = field(default_factory=list)
    reading: bool = True
    closed: bool = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


@dataclass
class ServerState:
    connections: set[Any] = field(default_factory=set)
    tasks: set[Any] = field(default_factory=set)


class App:
    """Answers each request with its path, once `release` is set for it."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.release = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.seen.append(scope["path"])
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": scope["path"].encode()})


def request(path: str) -> bytes:
    return lf.LinkRequest("POST", "/cluster/infer/" + path, (), b"").encode()


def test_a_peer_not_reading_its_answers_gets_no_more_requests_read_until_it_does() -> None:
    async def main() -> None:
        app, transport = App(), FakeTransport()
        link = LinkProtocol(app, ServerState(), {}, peer=None, max_body=1024, stall_s=5, idle_s=5)
        link.connection_made(transport)   # type: ignore[arg-type]
        link.data_received(request("one") + request("two"))
        await asyncio.sleep(0)
        assert app.seen == ["/cluster/infer/one"] and not transport.reading   # one request at a time
        link.pause_writing()   # the transport's buffer past its high-water mark: the peer is not reading
        app.release.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(transport.written) == 1 and transport.written[0].endswith(b"/one")
        assert app.seen == ["/cluster/infer/one"] and not transport.reading   # "/two" waits, read but not run
        link.resume_writing()
        for _ in range(5):
            await asyncio.sleep(0)
        assert app.seen == ["/cluster/infer/one", "/cluster/infer/two"] and transport.reading
        assert transport.written[1].endswith(b"/two")
        link.connection_lost(None)

    asyncio.run(main())


def test_a_body_claims_the_budget_from_its_head_and_a_link_cut_off_mid_body_gives_it_back() -> None:
    async def main() -> None:
        gateway_app = create_app(FakeService(), Metrics(), max_body_bytes=1000, max_inflight_bytes=1500)
        gate = gate_of(gateway_app)
        assert gate is not None
        link = LinkProtocol(App(), ServerState(), {}, peer=None, max_body=1000, stall_s=5, idle_s=5, gate=gate)
        link.connection_made(FakeTransport())   # type: ignore[arg-type]
        frame = lf.LinkRequest("POST", "/cluster/infer/affine/1", (), b"\0" * 900).encode()
        link.data_received(frame[:-800])   # the head and 100 bytes of the body
        assert gate.gateway.budget.held == 900
        link.connection_lost(None)
        assert gate.gateway.budget.held == 0

    asyncio.run(main())


def test_a_refused_body_is_read_past_without_being_kept_and_the_next_request_runs() -> None:
    async def main() -> None:
        gateway_app = create_app(FakeService(), Metrics(), max_body_bytes=1000, max_inflight_bytes=1000)
        gate = gate_of(gateway_app)
        assert gate is not None
        gate.gateway.budget.held = 950   # others' bodies
        app, transport = App(), FakeTransport()
        link = LinkProtocol(app, ServerState(), {}, peer=None, max_body=1000, stall_s=5, idle_s=5, gate=gate)
        link.connection_made(transport)   # type: ignore[arg-type]
        refused = lf.LinkRequest("POST", "/cluster/infer/big/1", (), b"\0" * 900).encode()
        link.data_received(refused[:-900])
        assert len(transport.written) == 1   # answered on its head
        assert lf.RESPONSE_HEAD.unpack(transport.written[0][:lf.RESPONSE_HEAD.size])[0] == 429
        for _ in range(8):   # the body, in pieces: none of it kept
            link.data_received(b"\0" * 100)
            assert link._body is not None and link._body.got > 0 and link._body.parts == []
        link.data_received(b"\0" * 100)
        assert link._body is None
        gate.gateway.budget.held = 0
        link.data_received(request("next"))
        await asyncio.sleep(0)
        assert app.seen == ["/cluster/infer/next"] and gate.gateway.budget.held == 0   # an empty body claims nothing
        app.release.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert transport.written[1].endswith(b"/next")
        link.connection_lost(None)

    asyncio.run(main())
