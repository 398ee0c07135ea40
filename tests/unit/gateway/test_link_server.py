"""A gateway link's flow control (ember/gateway/link_server.py), on a transport fake: a peer that stops reading its
answers gets no more of its requests read (or run) until it reads again."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ember.gateway.link_server import LinkProtocol
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
