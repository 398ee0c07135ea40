"""A request sent to a peer node's gateway, and its answer or error brought back; a stream opened on a peer, its
replies brought back as they come (frames: `ember.wire.cluster.FrameDecoder`). A unary request goes over a gateway
link (`ember.cluster.link_client`: two length-prefixed frames on the peer's own port, `ember.wire.link_frames`),
or over HTTP with `link=False` (`ember serve --gateway-links off`); a stream over HTTP (aiohttp).

It carries the caller's headers (`ember.gateway.caller`: API key, tenant, trace context): the peer admits it as
the caller's. With the node's TLS context (`ember.tls.NodeTls.client_context`) the link is mutual TLS.

Whether a failed request reached its node, as TCP tells (docs/cluster.md, "A node lost under traffic"):
`NotDelivered` when the peer's gateway never took it: no connection was made (refused, timed out, no route, the
TLS handshake failed), or the peer's kernel reset the connection before any reply (ECONNRESET, EPIPE: its process
was gone when the request came, or died with the request unread in its receive buffer; a gateway reads a whole
request before it runs anything); the caller may send it elsewhere. `NodeUnreachable` once the peer may have
read it: it closed the connection cleanly (FIN) with no reply, cut the reply off, fell silent past the timeout
(a machine without power resets nothing), or left the cluster's view. A kept-alive connection is looked at
before it is used again: one the peer has closed meanwhile (its FIN arrived, not yet read) is dropped, not
written to (a request written to it would end as a clean close, which cannot be told from a peer that took it).
Kept-alive connections are also closed after `keepalive_s`, below the peers' own keep-alive
(`--http-keepalive-s`, 5 s by default). A request still waiting on a node that leaves the cluster's view is
ended (`cut`), as its streams are.

aiohttp rather than httpx (the gateway's other client) for HTTP: on this hop its client costs less per request, and
this hop is what going across nodes costs (bench/cluster.py); it comes with Ray (ember[ray])."""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import ssl
from collections.abc import AsyncGenerator, Mapping
from urllib.parse import urlsplit

import aiohttp
from aiohttp.client_proto import ResponseHandler

import ember.errors as errors
from ember.cluster.link_client import LinkClient, closed_by_peer
from ember.core.states import Rung
from ember.errors import EmberError, NodeUnreachable, NotDelivered, WorkerCrashed
from ember.serving.results import InferResult, InferStream, JobAccepted
from ember.wire import bundle
from ember.wire.cluster import END, ERROR, REPLY, FrameDecoder
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

BINARY = "application/octet-stream"
# No connection was made: nothing of the request was sent. (A TLS handshake refused is a ClientConnectorError too.)
_NOT_CONNECTED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
_LOST = (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
_RESET = (errno.ECONNRESET, errno.EPIPE)
_SILENT = (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH)   # the kernel heard nothing back


def _silent(err: BaseException) -> bool:
    return isinstance(err, TimeoutError) or getattr(err, "errno", None) in _SILENT


class _Handler(ResponseHandler):
    """aiohttp's connection, taken from the pool only while the peer has not closed it (`closed_by_peer`)."""

    def is_connected(self) -> bool:
        transport = self.transport
        return (super().is_connected() and transport is not None
                and not closed_by_peer(transport.get_extra_info("socket")))


class _Connector(aiohttp.TCPConnector):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)   # type: ignore[arg-type]
        self._factory = functools.partial(_Handler, loop=self._loop)  # type: ignore[assignment]  # aiohttp's own:
        # functools.partial(ResponseHandler, loop=loop); a _Handler is one


def unanswered(url: str, err: BaseException) -> NodeUnreachable:
    """A forward that failed before any reply: NotDelivered when the peer never took the request (no connection,
    or reset: the kernel answered for a process that had not read it), else NodeUnreachable."""
    if isinstance(err, _NOT_CONNECTED):
        return NotDelivered(f"node {url} could not be reached: {type(err).__name__}: {err}",
                            answered=getattr(err, "errno", None) in (errno.ECONNREFUSED, errno.ECONNRESET))
    if _reset(err) or _reset(err.__cause__):
        return NotDelivered(f"node {url} reset the connection before answering, the request unread "
                            f"({type(err).__name__}: {err})", answered=True)
    return lost(url, err)


def _reset(err: BaseException | None) -> bool:
    """A reset (ECONNRESET, EPIPE), or a connection found closed as the request was being written (aiohttp's "Can
    not write request body", caused by its ConnectionResetError "Cannot write to closing transport"): the whole
    request never reached the peer, whose gateway runs nothing before it has read all of it."""
    return isinstance(err, ConnectionResetError | BrokenPipeError) or (isinstance(err, OSError)
                                                                        and err.errno in _RESET)


def lost(url: str, err: BaseException) -> NodeUnreachable:
    """A forward the peer may have read (closed cleanly, cut off its reply, or silent past the timeout)."""
    return NodeUnreachable(f"node {url} took the request and did not answer: {type(err).__name__}: {err}",
                           answered=not _silent(err))


def _error(body: object, status: int) -> EmberError:
    """The peer's error as the same EmberError class (by name), WorkerCrashed when it is not one of ours."""
    if not isinstance(body, dict):
        return WorkerCrashed(f"peer gateway answered {status}")
    message = str(body.get("message"))
    return (errors.error_named(body.get("kind"), message, body.get("retry_after"))
            or WorkerCrashed(f"peer gateway answered {status}: {message}"))


class Forwarder:
    """Pooled connections to every peer gateway: links for unary requests, HTTP for streams."""

    def __init__(self, request_timeout_s: float, tls: ssl.SSLContext | None = None, keepalive_s: float = 2.0,
                 answer_margin_s: float = 5.0, link: bool = True) -> None:
        """`request_timeout_s`: the server's (`ember serve --request-timeout-s`); a unary request waits for its
        model's own timeout (`limits.request_timeout_s`) or that, plus `answer_margin_s`: the peer's deadline
        comes first, and its answer (a 504) must still get back. `link`: unary requests over gateway links
        (`ember.cluster.link_client`), else over HTTP as streams are."""
        self._link = LinkClient(tls, keepalive_s) if link else None
        self._tls: ssl.SSLContext | bool = tls if tls is not None else True
        self._keepalive_s = keepalive_s
        self._request_timeout_s, self._margin_s = request_timeout_s, answer_margin_s
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s + answer_margin_s, connect=2.0)
        # A stream lasts as long as its generation, and opening it may wait for a cold start: no total, no read
        # timeout. A peer that dies resets the connection; one whose machine falls silent (no reset) leaves it
        # open until the client goes (docs/cluster.md, still to come).
        self._stream_timeout = aiohttp.ClientTimeout(total=None, connect=2.0)
        self._session: aiohttp.ClientSession | None = None
        self._open: dict[str, set[aiohttp.ClientResponse]] = {}   # streams open on each peer, by its URL
        self._waiting: dict[str, set[asyncio.Task[tuple[int, Mapping[str, str], bytes]]]] = {}   # unary, by URL

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:   # made on the server's event loop, on first use
            self._session = aiohttp.ClientSession(timeout=self._timeout,
                                                  connector=_Connector(
                                                      limit=0, limit_per_host=64, ssl=self._tls,
                                                      keepalive_timeout=self._keepalive_s))
        return self._session

    async def infer(self, url: str, contract: ModelContract, inputs: Tensors,
                    headers: Mapping[str, str]) -> InferResult | JobAccepted:
        """`headers`: the caller's (`ember.gateway.caller.forwarded_headers`). Raises NotDelivered when the peer
        could not be reached, NodeUnreachable when it took the request and cut it off, went silent past the
        timeout or left the view (`cut`); the peer's own errors as they were raised there."""
        call = asyncio.ensure_future(self._post(url, contract, inputs, headers))
        waiting = self._waiting.setdefault(url, set())
        waiting.add(call)
        try:
            status, headers, content = await call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():   # the caller itself was cancelled (its client left)
                raise
            raise NodeUnreachable(f"node {url} left the cluster's view while it held the request") from None
        finally:
            waiting.discard(call)
        if status == 200:
            return InferResult(bundle.unpack(content, "cluster body"), Rung(headers["x-ember-rung"]),
                               headers["x-ember-instance"])
        try:
            body = json.loads(content)
        except ValueError:
            body = None
        if status == 202 and isinstance(body, dict):
            return JobAccepted(str(body["job_id"]), float(body["retry_after"]))
        raise _error(body, status)

    async def _post(self, url: str, contract: ModelContract, inputs: Tensors,
                    headers: Mapping[str, str]) -> tuple[int, Mapping[str, str], bytes]:
        total_s = contract.limits.timeout_s(self._request_timeout_s) + self._margin_s
        path = f"/cluster/infer/{contract.name}/{contract.version}"
        if self._link is not None:
            try:
                async with asyncio.timeout(total_s):
                    answer = await self._link.exchange(url, "POST", path, {
                        **headers, "content-type": BINARY, "host": urlsplit(url).netloc}, bundle.pack(inputs))
            except TimeoutError as err:
                raise lost(url, err) from None
            return answer.status, {k.lower(): v for k, v in answer.headers}, answer.body
        timeout = aiohttp.ClientTimeout(total=total_s, connect=2.0)
        try:   # until the reply's head: a reset here is an unread request
            reply = await self._client().post(url + path, data=bundle.pack(inputs), headers=headers, timeout=timeout)
        except _LOST as err:
            raise unanswered(url, err) from None
        try:
            async with reply:
                return reply.status, reply.headers, await reply.read()
        except _LOST as err:
            raise lost(url, err) from None

    async def stream(self, url: str, contract: ModelContract, inputs: Tensors,
                     headers: Mapping[str, str]) -> InferStream:
        """The peer's stream, once its first reply came (or it ended without one). Raises NodeUnreachable when the
        peer is not there or cut the request off before its first reply (nothing has reached the client yet: the
        caller may retry it elsewhere), and the peer's own errors before then as they were raised there; after
        it, the replies raise them (a peer gone mid-stream: NodeUnreachable)."""
        try:
            reply = await self._client().post(f"{url}/cluster/stream/{contract.name}/{contract.version}",
                                              data=bundle.pack(inputs), headers=headers,
                                              timeout=self._stream_timeout)
        except _LOST as err:
            raise unanswered(url, err) from None
        if reply.status != 200:
            try:
                content = await reply.read()
            except _LOST as err:
                raise lost(url, err) from None
            finally:
                reply.release()
            try:
                body = json.loads(content)
            except ValueError:
                body = None
            raise _error(body, reply.status)
        # Closing it (the client went away) drops the connection: the peer sees the disconnect and withdraws it.
        self._open.setdefault(url, set()).add(reply)
        replies = self._replies(url, reply)
        try:
            first: Tensors | None = await anext(replies)
        except StopAsyncIteration:
            first = None
        except BaseException:   # cut off, the peer's error, or the client gone meanwhile: nothing reads it
            reply.close()
            raise
        return InferStream(Rung(reply.headers["x-ember-rung"]), reply.headers["x-ember-instance"],
                           _after(first, replies), on_close=reply.close)

    async def _replies(self, url: str, reply: aiohttp.ClientResponse) -> AsyncGenerator[Tensors, None]:
        try:
            async for tensors in _replies(url, reply):
                yield tensors
        finally:
            self._open.get(url, set()).discard(reply)

    def cut(self, url: str) -> int:
        """End every request waiting on and stream open on the peer at `url` (it left the cluster's view: a
        machine fallen silent resets no connection, so without this they would hang until their timeout or their
        clients leave); each ends with NodeUnreachable. How many were cut."""
        replies = self._open.pop(url, set())
        for reply in replies:
            reply.close()
        calls = self._waiting.pop(url, set())
        for call in calls:
            call.cancel()
        return len(replies) + len(calls)

    async def close(self) -> None:
        if self._link is not None:
            self._link.close()
        if self._session is not None:
            await self._session.close()


async def _after(first: Tensors | None, rest: AsyncGenerator[Tensors, None]) -> AsyncGenerator[Tensors, None]:
    """The replies of a stream whose first (None: none) was read already."""
    try:
        if first is None:
            return
        yield first
        async for tensors in rest:
            yield tensors
    finally:
        await rest.aclose()


async def _replies(url: str, reply: aiohttp.ClientResponse) -> AsyncGenerator[Tensors, None]:
    decoder = FrameDecoder()
    try:
        async for piece in reply.content.iter_any():
            for kind, payload in decoder.feed(piece):
                if kind == REPLY:
                    yield bundle.unpack(payload, "cluster body")
                    continue
                if kind == ERROR:
                    raise _error(json.loads(payload), 502)
                if kind == END:
                    reply.release()
                    return
    except _LOST as err:
        raise NodeUnreachable(f"node {url} cut the stream off: {type(err).__name__}: {err}",
                              answered=not _silent(err)) from None
    finally:
        reply.close()   # after END: released already, a no-op
    raise NodeUnreachable(f"node {url} cut the stream off ({decoder.pending} bytes of a frame)")
