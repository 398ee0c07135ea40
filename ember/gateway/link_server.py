"""A gateway's end of a link from another gateway (`ember.wire.link_frames`): requests as frames, each run
through the gateway's own ASGI app, as uvicorn runs an HTTP request (the same routes, admission, limits, metrics;
on TLS the other node's certificate in the scope).

A connection becomes a link when its first bytes are the link's preface (`ember.gateway.connections` looks,
then hands the transport over, as uvicorn hands one over to its WebSocket protocol). One request at a time: the
link stops reading until the answer is written. Links carry what gateways send each other, `POST /cluster/infer/...`
(another path is answered 404, a malformed head 400, the link kept); on a TLS gateway a link is taken only on a
connection whose client presented a node certificate.

A request is checked on its head, before a byte of its body is read (`LinkGate`): with API keys on, its caller's key
must be one (401), and its body must fit the gateway's in-flight budget of bodies beside the others (429 with
Retry-After, `max_inflight_mb`), which it then holds until answered, as an HTTP body does. A refused request is
answered at once and its body read past and dropped, holding none of it, so the link stays in step. Bounds as HTTP
has them: a request's body at most the gateway's `max_body_bytes` (larger: the link is dropped), a frame begun must
arrive whole within `stall_s` plus its body at `min_rate` bytes a second (at most `deadline_s`: the HTTP body's
pace, `ember.gateway.limits.BodyPace`, with `stall_s` for its grace), and a link idle for
`idle_s` (the keep-alive) is closed; the forwarding gateway closes its idle links before that. A peer that does not
read its answers gets no more of its requests read until it does (the transport's write buffer past its high-water
mark). On shutdown an idle link is closed at once, a busy one after its answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, cast

from starlette.requests import Request

from ember.errors import EmberError, InvalidInput, ModelNotFound, Overloaded, Unauthenticated, error_fields
from ember.gateway.context import Gateway
from ember.gateway.errors import retry_after_header, status_of
from ember.gateway.limits import BodyPace
from ember.tls import PEER_SCOPE_KEY
from ember.wire import link_frames as lf

LINKED_PATHS = "/cluster/infer/"   # what a link carries: unary forwarded requests (streams go over HTTP)

log = logging.getLogger("ember.gateway")


@dataclass(frozen=True)
class LinkGate:
    """What a link checks of a request on its head, before its body: the caller's API key (with keys on) and room for
    its body in the gateway's in-flight budget, claimed for the request (the route's own admission follows)."""

    gateway: Gateway

    def admit(self, scope: dict[str, Any], body_bytes: int) -> None:
        """Unauthenticated without a valid key, Overloaded when the budget has no room for the body."""
        request = Request(scope)
        try:
            self.gateway.auth.check_key(request.headers.get("authorization"))
        except Unauthenticated as err:
            raise Unauthenticated(f"link: {err} (checked before its body is read)") from None
        self.gateway.budget.claim(request, body_bytes)

    def release(self, scope: dict[str, Any]) -> None:
        """Hand back what the request claimed (nothing if its route has already)."""
        self.gateway.budget.release(Request(scope))


def gate_of(app: Any) -> LinkGate | None:
    """The gate of the gateway an ASGI app serves (uvicorn wraps the app in middleware, each holding the next as
    `app`); None for an app that is not a gateway's."""
    for _ in range(16):
        gateway = getattr(getattr(app, "state", None), "gateway", None)
        if isinstance(gateway, Gateway):
            return LinkGate(gateway)
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None


@dataclass
class _Body:
    """The body of the request being read: kept for `request` (method, path, headers, scope), or read past and
    dropped when the request was refused on its head (`request` None)."""

    size: int
    request: tuple[str, str, lf.Headers, dict[str, Any]] | None
    got: int = 0
    parts: list[bytes] = field(default_factory=list)

    @property
    def missing(self) -> int:
        return self.size - self.got

    def add(self, data: bytes) -> None:
        self.got += len(data)
        if self.request is not None:
            self.parts.append(data)


class LinkProtocol(asyncio.Protocol):
    def __init__(self, app: Any, server_state: Any, app_state: dict[str, Any], *, peer: str | None,
                 max_body: int, stall_s: float, idle_s: float, min_rate: float = 64 << 10,
                 deadline_s: float = 120.0, gate: LinkGate | None = None) -> None:
        self.app, self.server_state, self.app_state = app, server_state, app_state
        self.gate = gate   # None: nothing to check on a request's head (an app that is not a gateway's)
        self.peer, self.max_body, self.stall_s, self.idle_s = peer, max_body, stall_s, idle_s
        self.pace = BodyPace(timeout_s=stall_s, min_rate=min_rate, deadline_s=deadline_s, grace_s=stall_s)
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._sizes: tuple[int, int] | None = None   # (meta, body) of the request being read
        self._body: _Body | None = None               # its body, once its head was checked
        self._timer: asyncio.TimerHandle | None = None
        self._busy = False
        self._closing = False
        self._writing_paused = False   # the peer is not reading its answers: read no more requests until it does
        self._gone = asyncio.Event()
        self._scope: dict[str, Any] = {}

    # --- the connection -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)   # uvloop's are not asyncio.Transport subclasses
        self.server_state.connections.add(self)
        self._scope = {"server": _address(transport.get_extra_info("sockname")),
                       "client": _address(transport.get_extra_info("peername")),
                       "scheme": "https" if transport.get_extra_info("sslcontext") is not None else "http"}
        self._arm(self.idle_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        self._disarm()
        self._gone.set()
        if self._body is not None and self._body.request is not None and self.gate is not None:
            self.gate.release(self._body.request[3])   # a body cut off: its claim goes back
        self._body = None

    def shutdown(self) -> None:
        """uvicorn's shutdown: close now if idle, else once the answer in progress is written."""
        self._closing = True
        if not self._busy and self.transport is not None:
            self.transport.close()

    def pause_writing(self) -> None:
        self._writing_paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        if not self._busy and self.transport is not None and not self.transport.is_closing():
            self._next()

    def data_received(self, data: bytes) -> None:
        body = self._body
        if body is not None and not self._buf and len(data) <= body.missing:
            body.add(data)   # the body's bytes as they came: no copy
            data = b""
        self._buf += data
        try:
            self._take()
        except InvalidInput as err:
            log.warning("gateway link from %s dropped: %s", self._scope.get("client"), err)
            self._close()

    # --- reading one request ----------------------------------------------------------------------

    def _take(self) -> None:
        while (not self._busy and not self._writing_paused and self.transport is not None
               and not self.transport.is_closing()):
            if self._sizes is None:
                if len(self._buf) < lf.REQUEST_HEAD.size:
                    self._arm(self.stall_s if self._buf else self.idle_s)
                    return
                self._sizes = lf.request_sizes(bytes(self._buf[:lf.REQUEST_HEAD.size]), self.max_body)
                del self._buf[:lf.REQUEST_HEAD.size]
                self._arm(self.pace.whole_s(sum(self._sizes)))   # once: the whole frame by then
            meta_n, body_n = self._sizes
            if self._body is None:
                if len(self._buf) < meta_n:
                    return
                meta = bytes(self._buf[:meta_n])
                del self._buf[:meta_n]
                self._body = self._admit(meta, body_n)
            body = self._body
            if self._buf and body.missing:
                take = min(len(self._buf), body.missing)
                body.add(bytes(self._buf[:take]))
                del self._buf[:take]
            if body.missing:
                return
            self._sizes, self._body = None, None
            self._disarm()
            if body.request is not None:
                self._start(*body.request, b"".join(body.parts))

    def _admit(self, meta: bytes, body_n: int) -> _Body:
        """The request's head checked before its body is read: its body to keep, or one to read past (the request
        answered at once: a malformed head 400, another path 404, no valid key 401, no room in the budget 429)."""
        try:
            method, path, headers = lf.request_meta(meta)
            if method != "POST" or not path.startswith(LINKED_PATHS):
                raise ModelNotFound(f"link: {method} {path[:100]}: a gateway link carries only POST "
                                    f"{LINKED_PATHS}...")
            scope = self._scope_of(method, path, headers)
            if self.gate is not None:
                self.gate.admit(scope, body_n)
        except EmberError as err:
            self._answer(_Reply.error(err))
            return _Body(body_n, None)
        return _Body(body_n, (method, path, headers, scope))

    def _start(self, method: str, path: str, headers: lf.Headers, scope: dict[str, Any], body: bytes) -> None:
        self._busy = True
        assert self.transport is not None
        self.transport.pause_reading()   # one request at a time
        task = asyncio.get_running_loop().create_task(self._run(method, path, scope, body))
        self.server_state.tasks.add(task)
        task.add_done_callback(self.server_state.tasks.discard)

    # --- running it through the app ---------------------------------------------------------------

    async def _run(self, method: str, path: str, scope: dict[str, Any], body: bytes) -> None:
        reply = _Reply()
        try:
            await self.app(scope, _receiver(body, self._gone), reply.send)
        except Exception:
            log.exception("gateway link: the app failed on %s %s", method, path)
            reply = _Reply(500)
        except BaseException:   # cancelled (a shutdown that would not wait): no answer, so no link
            self._close()
            raise
        finally:
            if self.gate is not None:
                self.gate.release(scope)   # its route released it, unless the request never reached one
        self._busy = False
        self._answer(reply)
        if self._closing:
            self._close()
        elif not self._writing_paused:   # else once the peer has read enough (resume_writing)
            self._next()

    def _answer(self, reply: _Reply) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(lf.LinkResponse(reply.status if reply.started else 500, reply.headers,
                                                 b"".join(reply.body)).encode())

    def _next(self) -> None:
        assert self.transport is not None
        self.transport.resume_reading()
        try:
            self._take()   # a next request may have arrived whole meanwhile
        except InvalidInput as err:
            log.warning("gateway link from %s dropped: %s", self._scope.get("client"), err)
            self._close()

    def _scope_of(self, method: str, path: str, headers: lf.Headers) -> dict[str, Any]:
        raw_path, _, query = path.partition("?")
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 **self._scope, "root_path": "", "method": method, "path": urllib.parse.unquote(raw_path),
                 "raw_path": raw_path.encode(), "query_string": query.encode(),
                 "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
                 "state": self.app_state.copy()}
        if self.peer is not None:
            scope[PEER_SCOPE_KEY] = self.peer
        return scope

    # --- timers ---------------------------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._close)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _close(self) -> None:
        self._disarm()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class _Reply:
    """What the app sends back, gathered whole (a link answers in one frame)."""

    def __init__(self, status: int | None = None) -> None:
        self.status, self.started = status or 500, status is not None
        self.headers: lf.Headers = ()
        self.body: list[bytes] = []

    @classmethod
    def error(cls, err: EmberError) -> _Reply:
        reply = cls(status_of(err))
        retry = retry_after_header(err.retry_after) if isinstance(err, Overloaded) else {}
        reply.headers = (("content-type", "application/json"), *retry.items())
        reply.body = [json.dumps(error_fields(err)).encode()]
        return reply

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status, self.started = int(message["status"]), True
            self.headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", ()))
        elif message["type"] == "http.response.body":
            self.body.append(bytes(message.get("body", b"")))


def _address(value: Any) -> list[Any] | None:
    """An ASGI address, [host, port] (an IPv6 socket's has four parts)."""
    return list(value[:2]) if isinstance(value, tuple | list) and len(value) >= 2 else None


def _receiver(body: bytes, gone: asyncio.Event) -> Any:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()   # after the body: only the link's end
        return {"type": "http.disconnect"}

    return receive
