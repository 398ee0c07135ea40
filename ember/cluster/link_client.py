"""The forwarding gateway's end of links to its peers (`ember.wire.link_frames`): kept-alive connections, one
request at a time on each; a `Transport`, whether a failed request reached its peer told by the one rule
(`ember.cluster.delivery`; not connected within `connect_s`: not reached; silent past the caller's timeout: the
caller's TimeoutError, which it counts as lost).

A connection is looked at before it is used again (`closed_by_peer`: one whose FIN or RST came while it lay idle
is dropped, not written to) and closed after `keepalive_s` idle, below the peers' own keep-alive. A connection that
failed, or whose request was cancelled (its caller gone, its node cut), is closed, never reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

from ember.cluster.delivery import Answer, before_answer, closed_by_peer, not_reached, took
from ember.errors import InvalidInput
from ember.wire import link_frames as lf

MAX_ANSWER = 1 << 30

Link = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class LinkClient:
    """Links to every peer gateway, kept alive; `exchange` sends one request on one of them."""

    def __init__(self, tls: ssl.SSLContext | None = None, keepalive_s: float = 2.0, connect_s: float = 2.0) -> None:
        self._tls, self._keepalive_s, self._connect_s = tls, keepalive_s, connect_s
        self._idle: dict[str, list[tuple[Link, float]]] = {}

    async def exchange(self, url: str, method: str, path: str, headers: Mapping[str, str],
                       body: bytes) -> Answer:
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
            raise not_reached(url, err) from None
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
                         request: bytes) -> Answer:
    """`request`: encoded, after the preface on a new link (one write: one segment where it fits)."""
    try:
        writer.write(request)
        await writer.drain()
        head = await reader.readexactly(lf.RESPONSE_HEAD.size)
    except asyncio.IncompleteReadError as err:
        raise took(url, "cut its answer off" if err.partial else "closed the connection without an answer") from None
    except OSError as err:
        raise before_answer(url, err) from None
    try:
        status, meta_n, body_n = lf.response_sizes(head, MAX_ANSWER)
        meta = lf.response_meta(await reader.readexactly(meta_n))
        body = await reader.readexactly(body_n)
    except (asyncio.IncompleteReadError, OSError, InvalidInput) as err:
        raise took(url, f"its answer broke off: {type(err).__name__}: {err}") from None
    return Answer(status, {k.lower(): v for k, v in meta}, body)
