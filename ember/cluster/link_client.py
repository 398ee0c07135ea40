"""The forwarding gateway's end of links to its peers (`ember.wire.link_frames`): kept-alive connections, one
request at a time on each, and whether a failed request reached its peer, by the same rules as over HTTP
(`ember.cluster.forward`'s docstring):

- no connection made (refused, no route, the TLS handshake failed, not within `connect_s`): `NotDelivered`;
- reset (ECONNRESET, EPIPE) before any byte of the answer: `NotDelivered` (its kernel answered for a process that
  had not read the request: a gateway reads a request whole before it runs anything);
- closed cleanly (FIN) before or during the answer, or a malformed answer: `NodeUnreachable` (it may have run);
- silent past the caller's timeout: the caller's TimeoutError, which it counts as `NodeUnreachable`.

A connection is looked at before it is used again (`closed_by_peer`: one whose FIN or RST came while it lay idle
is dropped, not written to) and closed after `keepalive_s` idle, below the peers' own keep-alive. A connection that
failed, or whose request was cancelled (its caller gone, its node cut), is closed, never reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import select
import socket
import ssl
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

from ember.errors import InvalidInput, NodeUnreachable, NotDelivered
from ember.wire import link_frames as lf

MAX_ANSWER = 1 << 30
_RESET = (errno.ECONNRESET, errno.EPIPE)

Link = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def closed_by_peer(sock: socket.socket | None) -> bool:
    """Whether the peer has closed or reset this idle connection: its FIN or RST arrived, whether or not data came
    before it (a TLS peer sends its close alert, then FIN). A poll that does not wait and reads nothing; data
    waiting without a FIN counts as open."""
    if sock is None:
        return False
    poller = select.poll()
    try:
        poller.register(sock.fileno(), select.POLLIN | select.POLLRDHUP)
        events = poller.poll(0)
    except (OSError, ValueError):   # no longer a socket (closed: its descriptor is -1)
        return True
    gone = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL
    return any(mask & gone for _fd, mask in events)


class LinkClient:
    """Links to every peer gateway, kept alive; `exchange` sends one request on one of them."""

    def __init__(self, tls: ssl.SSLContext | None = None, keepalive_s: float = 2.0, connect_s: float = 2.0) -> None:
        self._tls, self._keepalive_s, self._connect_s = tls, keepalive_s, connect_s
        self._idle: dict[str, list[tuple[Link, float]]] = {}

    async def exchange(self, url: str, method: str, path: str, headers: Mapping[str, str],
                       body: bytes) -> lf.LinkResponse:
        """One request to the gateway at `url` (`http(s)://host:port`); its answer, whatever its status."""
        link = self._reuse(url)
        opening = link is None
        if link is None:
            link = await self._open(url)
        reader, writer = link
        kept = False
        try:
            request = lf.LinkRequest(method, path, tuple(headers.items()), body).encode()
            answer = await _send_and_read(url, reader, writer, lf.PREFACE + request if opening else request)
            kept = True
            return answer
        finally:
            if kept and not writer.is_closing():
                self._idle.setdefault(url, []).append((link, time.monotonic()))
            else:
                writer.close()   # failed or cancelled midway: never reused

    def _reuse(self, url: str) -> Link | None:
        """The most recently used idle link to `url` still open. Idle links past the keep-alive, to any peer (one
        that left the view too), are closed on the way, and those to `url` found closed by the peer."""
        now = time.monotonic()
        for peer, idle in list(self._idle.items()):
            fresh = []
            for link, since in idle:
                if now - since < self._keepalive_s:
                    fresh.append((link, since))
                else:
                    link[1].close()
            if fresh:
                self._idle[peer] = fresh
            else:
                del self._idle[peer]
        idle = self._idle.get(url, [])
        while idle:
            (reader, writer), _since = idle.pop()
            if not writer.is_closing() and not closed_by_peer(writer.get_extra_info("socket")):
                return reader, writer
            writer.close()
        return None

    async def _open(self, url: str) -> Link:
        parts = urlsplit(url)
        tls = self._tls if parts.scheme == "https" else None
        if parts.scheme == "https" and tls is None:
            tls = ssl.create_default_context()
        try:
            async with asyncio.timeout(self._connect_s):
                port = parts.port or (443 if parts.scheme == "https" else 80)
                reader, writer = await asyncio.open_connection(parts.hostname, port, ssl=tls,
                                                               limit=1 << 20)
        except (OSError, TimeoutError, ssl.SSLError) as err:
            raise NotDelivered(f"node {url} could not be reached: {type(err).__name__}: {err}",
                               answered=getattr(err, "errno", None) in (errno.ECONNREFUSED, errno.ECONNRESET)) \
                from None
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    def close(self) -> None:
        for links in self._idle.values():
            for (_reader, writer), _since in links:
                with contextlib.suppress(RuntimeError):   # its loop already closed (a server thread's that ended)
                    writer.close()
        self._idle.clear()


async def _send_and_read(url: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         request: bytes) -> lf.LinkResponse:
    """`request`: encoded, after the preface on a new link (one write: one segment where it fits)."""
    try:
        writer.write(request)
        await writer.drain()
        head = await reader.readexactly(lf.RESPONSE_HEAD.size)
    except asyncio.IncompleteReadError as err:
        if err.partial:
            raise _lost(url, "cut its answer off") from None
        raise _lost(url, "closed the connection without an answer") from None
    except OSError as err:
        if isinstance(err, ConnectionResetError | BrokenPipeError) or err.errno in _RESET:
            raise NotDelivered(f"node {url} reset the connection before answering, the request unread "
                               f"({type(err).__name__}: {err})", answered=True) from None
        raise _lost(url, f"{type(err).__name__}: {err}") from None
    try:
        status, meta_n, body_n = lf.response_sizes(head, MAX_ANSWER)
        meta = await reader.readexactly(meta_n)
        body = await reader.readexactly(body_n)
        return lf.LinkResponse(status, lf.response_meta(meta), body)
    except (asyncio.IncompleteReadError, OSError, InvalidInput) as err:
        raise _lost(url, f"its answer broke off: {type(err).__name__}: {err}") from None


def _lost(url: str, what: str) -> NodeUnreachable:
    return NodeUnreachable(f"node {url} took the request and {what}", answered=True)

