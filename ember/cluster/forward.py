"""A request sent to a peer node's gateway, and its answer or error brought back; a stream opened on a peer, its
replies brought back as they come (frames: `ember.wire.cluster.FrameDecoder`). A unary request goes by one of two
transports (`ember.cluster.delivery.Transport`, as httpx keeps its transports): a gateway link
(`ember.cluster.link_client`: two length-prefixed frames on the peer's own port, `ember.wire.link_frames`), or HTTP
(`HttpTransport`, with `link=False`: `ember serve --gateway-links off`); a stream goes over HTTP (aiohttp).

It carries the caller's headers (`ember.gateway.caller`: API key, tenant, trace context): the peer admits it as
the caller's. With the node's TLS context (`ember.tls.NodeTls.client_context`) the link is mutual TLS.

Whether a failed request reached its node is the one rule of `ember.cluster.delivery`, whichever the transport:
`NotDelivered` when the peer's gateway never took it (the caller may send it elsewhere), `NodeUnreachable` once the
peer may have read it, or when it left the cluster's view. A kept-alive connection is looked at before it is used
again (`closed_by_peer`), and closed after `keepalive_s`, below the peers' own keep-alive (`--http-keepalive-s`, 5 s
by default). A request still waiting on a node that leaves the cluster's view is ended (`cut`), as its streams are.

aiohttp rather than httpx (the gateway's other client) for HTTP: on this hop its client costs less per request, and
this hop is what going across nodes costs (bench/cluster.py); it comes with Ray (ember[ray])."""

from __future__ import annotations

import asyncio
import functools
import json
import ssl
from collections.abc import AsyncGenerator, Callable, Mapping
from urllib.parse import urlsplit

import aiohttp
from aiohttp.client_proto import ResponseHandler

import ember.errors as errors
from ember.cluster.delivery import Answer, Transport, before_answer, closed_by_peer, lost, not_reached, silent
from ember.cluster.link_client import LinkClient
from ember.core.states import Rung
from ember.errors import EmberError, NodeUnreachable, WorkerCrashed
from ember.serving.results import InferResult, InferStream, JobAccepted
from ember.wire import bundle
from ember.wire.cluster import END, ERROR, REPLY, FrameDecoder
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

BINARY = "application/octet-stream"
# No connection was made: nothing of the request was sent. (A TLS handshake refused is a ClientConnectorError too.)
_NOT_CONNECTED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
_LOST = (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)


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
    """An HTTP request that failed before any reply, by the delivery rule: no connection made (aiohttp's connector
    error, or its connect timeout) is not reached; after one, `before_answer`."""
    return not_reached(url, err) if isinstance(err, _NOT_CONNECTED) else before_answer(url, err)


class HttpTransport:
    """Unary requests over HTTP, on the forwarder's pooled aiohttp session (`client`); the caller bounds the whole
    exchange, the connection is made within `connect_s` or not at all."""

    def __init__(self, client: Callable[[], aiohttp.ClientSession], connect_s: float = 2.0) -> None:
        self._client, self._timeout = client, aiohttp.ClientTimeout(total=None, connect=connect_s)

    async def exchange(self, url: str, method: str, path: str, headers: Mapping[str, str],
                       body: bytes) -> Answer:
        try:   # until the reply's head: a reset here is an unread request
            reply = await self._client().request(method, url + path, data=body, headers=headers,
                                                 timeout=self._timeout)
        except _LOST as err:
            raise unanswered(url, err) from None
        try:
            async with reply:
                return Answer(reply.status, {k.lower(): v for k, v in reply.headers.items()}, await reply.read())
        except _LOST as err:
            raise lost(url, err) from None


def _error(body: object, status: int) -> EmberError:
    """The peer's error as the same EmberError class (by name), WorkerCrashed when it is not one of ours."""
    if not isinstance(body, dict):
        return WorkerCrashed(f"peer gateway answered {status}")
    message = str(body.get("message"))
    return (errors.error_named(body.get("kind"), message, body.get("retry_after"))
            or WorkerCrashed(f"peer gateway answered {status}: {message}"))


class Forwarder:
    """Pooled connections to every peer gateway: a transport for unary requests (links, or HTTP), HTTP for streams."""

    def __init__(self, request_timeout_s: float, tls: ssl.SSLContext | None = None, keepalive_s: float = 2.0,
                 answer_margin_s: float = 5.0, link: bool = True) -> None:
        """`request_timeout_s`: the server's (`ember serve --request-timeout-s`); a unary request waits for its
        model's own timeout (`limits.request_timeout_s`) or that, plus `answer_margin_s`: the peer's deadline
        comes first, and its answer (a 504) must still get back. `link`: unary requests over gateway links
        (`ember.cluster.link_client`), else over HTTP as streams are."""
        self._link = LinkClient(tls, keepalive_s) if link else None
        self._unary: Transport = self._link if self._link is not None else HttpTransport(self._client)
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
        try:
            async with asyncio.timeout(total_s):
                answer = await self._unary.exchange(url, "POST", path, {
                    **headers, "content-type": BINARY, "host": urlsplit(url).netloc}, bundle.pack(inputs))
        except TimeoutError as err:
            raise lost(url, err) from None
        return answer.status, answer.headers, answer.body

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
                              answered=not silent(err)) from None
    finally:
        reply.close()   # after END: released already, a no-op
    raise NodeUnreachable(f"node {url} cut the stream off ({decoder.pending} bytes of a frame)")
