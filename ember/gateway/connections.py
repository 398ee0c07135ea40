"""Connections the gateway holds: bounded in number (below the open-files limit) and in how long they may idle.

uvicorn closes a kept-alive connection after `timeout_keep_alive` and answers 503 past `limit_concurrency`, but
it arms no timer on a connection until it has answered one request on it, and it accepts past its limit: a
client that opens sockets and sends nothing (or sends its headers a byte a minute) holds them, and an open-files
descriptor each, for ever. `guarded_protocol` adds what is missing: a connection whose request headers are not
complete within `header_timeout_s` of its start (or of the request's first byte) is closed, and a connection
past `max_connections` is answered 503 and closed at once. The body's own stall timeout is the gateway's
(ember.gateway.limits, 408).

On a TLS gateway (`--tls-dir`) it also names the other node on a connection whose client presented a
certificate (verified against the cluster CA by the handshake): every request on it carries that node's name
in its scope (`ember.tls.PEER_SCOPE_KEY`), which the cluster routes require (ember/gateway/cluster_api.py).
A gateway link is taken only where the app is a gateway's, whose keys and body budget its requests' heads are
checked against before their bodies are read (`ember.gateway.link_server.LinkGate`).
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ember.gateway.link_server import LinkGate, LinkProtocol, gate_of
from ember.tls import PEER_SCOPE_KEY, peer_name
from ember.wire import link_frames as lf

log = logging.getLogger("ember.gateway")

# Descriptors kept for everything but client connections: instances' sockets, the job store, weights, logs.
RESERVED_FDS = 256
_REFUSED_BODY = b'{"error": "too many connections: the server is at its cap; retry shortly"}'
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(_REFUSED_BODY), _REFUSED_BODY))


def raise_open_files_limit() -> int:
    """Raise the soft open-files limit to the hard one where allowed; the soft limit in force after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as err:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, err)
    return soft


def connection_cap(wanted: int, open_files: int) -> int:
    """Client connections the gateway takes at once: what was asked, but always below the open-files limit."""
    return max(1, min(wanted, open_files - RESERVED_FDS))


def guarded_protocol(header_timeout_s: float, max_connections: int, max_body_bytes: int = 100 << 20,
                     body_min_rate: float = 64 << 10, body_deadline_s: float = 120.0) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a header timeout and a hard connection cap (see the module docstring); a
    connection that opens with the gateway link's preface is handed to `LinkProtocol` (on a TLS gateway only one
    whose client presented a node certificate; `max_body_bytes`, `body_min_rate` and `body_deadline_s` bound its
    requests as the routes bound HTTP bodies)."""

    class Guarded(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _peer: str | None = None
        _first: bytes | None = b""   # the connection's first bytes while it may still be a link; None: HTTP

        def data_received(self, data: bytes) -> None:
            if self._first is not None:
                data, self._first = self._first + data, None
                if lf.PREFACE.startswith(data):   # too few bytes yet to tell
                    self._first = data
                    return
                if data.startswith(lf.PREFACE) and (self._peer is not None or not self._tls()):
                    gate = gate_of(self.app)
                    if gate is not None:   # else read as HTTP, which it is not: a 400
                        self._to_link(gate, data[len(lf.PREFACE):])
                        return
            super().data_received(data)

        def _to_link(self, gate: LinkGate, rest: bytes) -> None:
            """The gateway link (`ember.gateway.link_server`), as uvicorn hands a connection to its WebSocket."""
            self._disarm()
            self.connections.discard(self)
            link = LinkProtocol(self.app, self.server_state, self.app_state, peer=self._peer,
                                max_body=max_body_bytes, stall_s=header_timeout_s, idle_s=self.timeout_keep_alive,
                                min_rate=body_min_rate, deadline_s=body_deadline_s, gate=gate)
            link.connection_made(self.transport)
            self.transport.set_protocol(link)
            if rest:
                link.data_received(rest)

        def _tls(self) -> bool:
            return self.transport.get_extra_info("sslcontext") is not None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._peer = peer_name(transport.get_extra_info("peercert"))   # after the handshake: verified
            if len(self.connections) > max_connections:
                transport.write(_REFUSED)
                transport.close()
                return
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._peer is not None:
                self.scope[PEER_SCOPE_KEY] = self._peer  # type: ignore[literal-required]
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return Guarded


def uvicorn_limits(http_keepalive_s: float, max_connections: int) -> dict[str, Any]:
    """The uvicorn.Config settings that bound connections (the protocol class comes from `guarded_protocol`)."""
    return {"timeout_keep_alive": http_keepalive_s, "limit_concurrency": max_connections,
            "h11_max_incomplete_event_size": 64 * 1024, "backlog": min(2048, max_connections)}
