"""Was a forwarded request delivered? The one rule, as TCP tells, for both transports a gateway sends a unary request
to a peer by (HTTP: `ember.cluster.forward.HttpTransport`; a gateway link: `ember.cluster.link_client.LinkClient`;
docs/cluster.md, "A node lost under traffic"):

- no connection made (refused, timed out, no route, the TLS handshake failed): `NotDelivered` (`not_reached`);
- reset (ECONNRESET, EPIPE) before any byte of the answer: `NotDelivered` (`unread`): the peer's kernel answered for
  a process that had not read the request (gone when it came, or dead with it unread in its receive buffer; a
  gateway reads a request whole before it runs anything); the caller may send it elsewhere;
- closed cleanly (FIN) with no answer or during it, a malformed answer, silent past the timeout (a machine without
  power resets nothing): `NodeUnreachable` (`took`, `lost`): the peer may have read it and run it.

A kept-alive connection is looked at before it is used again (`closed_by_peer`): one the peer closed or reset while
it lay idle is dropped, not written to (a request written to it would end as a clean close, which cannot be told
from a peer that took it). Both transports answer `exchange` alike (`Transport`): the peer's answer whatever its
status, or one of those errors.
"""

from __future__ import annotations

import errno
import select
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from ember.errors import NodeUnreachable, NotDelivered

RESET = (errno.ECONNRESET, errno.EPIPE)
SILENT = (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH)   # the kernel heard nothing back


@dataclass(frozen=True)
class Answer:
    """A peer gateway's answer: its status, headers (names in lower case) and body."""

    status: int
    headers: Mapping[str, str]
    body: bytes

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


class Transport(Protocol):
    async def exchange(self, url: str, method: str, path: str, headers: Mapping[str, str],
                       body: bytes) -> Answer:
        """One request to the gateway at `url` (`http(s)://host:port`): its answer, whatever its status; else
        NotDelivered or NodeUnreachable by the rule above."""
        ...


def silent(err: BaseException) -> bool:
    return isinstance(err, TimeoutError) or getattr(err, "errno", None) in SILENT


def is_reset(err: BaseException | None) -> bool:
    """A reset (ECONNRESET, EPIPE): the whole request never reached the peer's process."""
    return isinstance(err, ConnectionResetError | BrokenPipeError) or (isinstance(err, OSError)
                                                                        and err.errno in RESET)


def not_reached(url: str, err: BaseException) -> NotDelivered:
    """No connection was made: nothing of the request was sent (answered: refused, or reset while connecting)."""
    return NotDelivered(f"node {url} could not be reached: {type(err).__name__}: {err}",
                        answered=getattr(err, "errno", None) in (errno.ECONNREFUSED, errno.ECONNRESET))


def unread(url: str, err: BaseException) -> NotDelivered:
    return NotDelivered(f"node {url} reset the connection before answering, the request unread "
                        f"({type(err).__name__}: {err})", answered=True)


def took(url: str, what: str, answered: bool = True) -> NodeUnreachable:
    return NodeUnreachable(f"node {url} took the request and {what}", answered=answered)


def lost(url: str, err: BaseException) -> NodeUnreachable:
    """A request the peer may have read (closed cleanly, cut off its answer, or silent past the timeout)."""
    return took(url, f"did not answer: {type(err).__name__}: {err}", answered=not silent(err))


def before_answer(url: str, err: BaseException) -> NodeUnreachable:
    """A connection made, then no byte of the answer: a reset (the error's, or the one under it) is an unread
    request, anything else one the peer may have read."""
    return unread(url, err) if is_reset(err) or is_reset(err.__cause__) else lost(url, err)


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
