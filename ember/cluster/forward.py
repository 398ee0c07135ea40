"""A request sent to a peer node's gateway over HTTP (aiohttp), and its answer or error brought back; a stream
opened on a peer, its replies brought back as they come (frames: `ember.wire.cluster.FrameDecoder`).

It carries the caller's headers (`ember.gateway.caller`: API key, tenant, trace context): the peer admits it as
the caller's. With the node's TLS context (`ember.tls.NodeTls.client_context`) the link is mutual TLS.

Whether a failed request reached its node: `NotDelivered` when no connection was made (refused, timed out,
no route, the TLS handshake failed): no byte of it left this node, and the caller may send it elsewhere;
`NodeUnreachable` once it was sent (the node may have run it and been lost before it answered). Kept-alive
connections are closed after `keepalive_s`, below the peers' own keep-alive (`--keepalive-timeout-s`, 5 s by
default): a request is never written to a connection the peer may have closed meanwhile, which would fail as
sent. A request still waiting on a node that leaves the cluster's view is ended (`cut`), as its streams are.

aiohttp rather than httpx (the gateway's other client): on this hop its client costs less per request, and
this hop is what going across nodes costs (bench/cluster.py); it comes with Ray (ember[ray])."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncGenerator, Mapping

import aiohttp

import ember.errors as errors
from ember.core.states import Rung
from ember.errors import EmberError, NodeUnreachable, NotDelivered, WorkerCrashed
from ember.serving.results import InferResult, InferStream, JobAccepted
from ember.wire.cluster import END, ERROR, REPLY, FrameDecoder, pack_tensors, unpack_tensors
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

# No connection was made: nothing of the request was sent. (A TLS handshake refused is a ClientConnectorError too.)
_NOT_CONNECTED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


def _error(body: object, status: int) -> EmberError:
    """The peer's error as the same EmberError class (by name), WorkerCrashed when it is not one of ours."""
    kind = body.get("kind") if isinstance(body, dict) else None
    message = str(body.get("message")) if isinstance(body, dict) else f"peer answered {status}"
    cls = getattr(errors, str(kind), None)
    if not (isinstance(cls, type) and issubclass(cls, EmberError)):
        return WorkerCrashed(f"peer gateway answered {status}: {message}")
    retry = body.get("retry_after") if isinstance(body, dict) else None
    if issubclass(cls, errors.Overloaded | errors.JobStoreError) and isinstance(retry, int | float):
        return cls(message, retry)
    try:
        return cls(message)
    except TypeError:   # a class that wants more than a message
        return WorkerCrashed(message)


class Forwarder:
    """One pooled HTTP client to every peer gateway."""

    def __init__(self, timeout_s: float, tls: ssl.SSLContext | None = None, keepalive_s: float = 2.0) -> None:
        self._tls: ssl.SSLContext | bool = tls if tls is not None else True
        self._keepalive_s = keepalive_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=2.0)
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
                                                  connector=aiohttp.TCPConnector(
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
            return InferResult(unpack_tensors(content), Rung(headers["x-ember-rung"]), headers["x-ember-instance"])
        try:
            body = json.loads(content)
        except ValueError:
            body = None
        if status == 202 and isinstance(body, dict):
            return JobAccepted(str(body["job_id"]), float(body["retry_after"]))
        raise _error(body, status)

    async def _post(self, url: str, contract: ModelContract, inputs: Tensors,
                    headers: Mapping[str, str]) -> tuple[int, Mapping[str, str], bytes]:
        try:
            async with self._client().post(f"{url}/cluster/infer/{contract.name}/{contract.version}",
                                           data=pack_tensors(inputs), headers=headers) as reply:
                return reply.status, reply.headers, await reply.read()
        except _NOT_CONNECTED as err:
            raise NotDelivered(f"node {url} could not be reached: {type(err).__name__}: {err}") from None
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as err:
            raise NodeUnreachable(f"node {url} took the request and did not answer: {type(err).__name__}: "
                                  f"{err}") from None

    async def stream(self, url: str, contract: ModelContract, inputs: Tensors,
                     headers: Mapping[str, str]) -> InferStream:
        """The peer's stream, once its first reply came (or it ended without one). Raises NodeUnreachable when the
        peer is not there or cut the request off before its first reply (nothing has reached the client yet: the
        caller may retry it elsewhere), and the peer's own errors before then as they were raised there; after
        it, the replies raise them (a peer gone mid-stream: NodeUnreachable)."""
        try:
            reply = await self._client().post(f"{url}/cluster/stream/{contract.name}/{contract.version}",
                                              data=pack_tensors(inputs), headers=headers,
                                              timeout=self._stream_timeout)
        except _NOT_CONNECTED as err:
            raise NotDelivered(f"node {url} could not be reached: {type(err).__name__}: {err}") from None
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as err:
            raise NodeUnreachable(f"node {url}: {type(err).__name__}: {err}") from None
        if reply.status != 200:
            try:
                content = await reply.read()
            except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as err:
                raise NodeUnreachable(f"node {url}: {type(err).__name__}: {err}") from None
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
                    yield unpack_tensors(payload)
                    continue
                if kind == ERROR:
                    raise _error(json.loads(payload), 502)
                if kind == END:
                    reply.release()
                    return
    except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as err:
        raise NodeUnreachable(f"node {url} cut the stream off: {type(err).__name__}: {err}") from None
    finally:
        reply.close()   # after END: released already, a no-op
    raise NodeUnreachable(f"node {url} cut the stream off ({decoder.pending} bytes of a frame)")
