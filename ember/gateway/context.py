"""What every endpoint reaches through the request: the service (as the caller may see it), metrics, limits and
tracer."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import weakref
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio.to_thread
from starlette.requests import Request

from ember.errors import Cancelled, InvalidInput
from ember.gateway.access_log import AccessLog
from ember.gateway.auth import Auth
from ember.gateway.service import Service
from ember.metrics import Metrics
from ember.serving.ports import NO_SPAN, NoTracer, Span, Tracer

if TYPE_CHECKING:
    from ember.gateway.limits import BodyBudget
    from ember.gateway.store_api import ChunkFiles

T = TypeVar("T")

# Bodies above this are parsed and encoded on a worker thread, so a big request does not
# hold up the event loop (and with it every other request).
OFF_LOOP_BYTES = 256 * 1024


class RequestTracer(Tracer, Protocol):
    def request(self, name: str, headers: Mapping[str, str]) -> AbstractContextManager[Span]:
        """The root span of one HTTP request, current inside the block (the parent of every span the request's
        work starts); it continues the caller's trace given in `headers` (W3C `traceparent`). Not ended by the
        block: the caller ends it once the response is sent."""

    def context_headers(self) -> dict[str, str]:
        """The current span's trace context as W3C headers (`traceparent`, ...), for a request sent on to another
        node; {} with tracing off."""


class NoRequestTracer(NoTracer):
    """Tracing off."""

    def request(self, name: str, headers: Mapping[str, str]) -> AbstractContextManager[Span]:
        return contextlib.nullcontext(NO_SPAN)

    def context_headers(self) -> dict[str, str]:
        return {}


@dataclass(frozen=True)
class Gateway:
    service: Service
    metrics: Metrics
    max_body_bytes: int
    started_at: int  # unix seconds; OpenAI's `created` for every model
    budget: BodyBudget
    body_timeout_s: float
    body_min_rate: float = 64 * 1024       # bytes/s on average (0: none); limits.DEFAULT_BODY_MIN_RATE
    body_deadline_s: float = 120.0         # limits.DEFAULT_BODY_DEADLINE_S
    access_log: AccessLog | None = None
    tracer: RequestTracer = field(default_factory=NoRequestTracer)
    auth: Auth = field(default_factory=Auth)
    chunks: ChunkFiles | None = None   # the node's weight-store chunks, served to peers (None: no store)


def gateway_of(request: Request) -> Gateway:
    """The app's gateway; once `_guard` admitted an API key, one whose service is that tenant's view."""
    gateway: Gateway = getattr(request.state, "gateway", None) or request.app.state.gateway
    return gateway


def label_model(request: Request, key: str) -> None:
    """Name the model (`name:version`) in this request's metrics (only models that exist: labels stay bounded)."""
    request.state.model = key


def prefers_async(request: Request) -> bool:
    """RFC 7240 `Prefer: respond-async` (among other comma-separated preferences)."""
    prefer = request.headers.get("prefer", "")
    return any(p.split(";")[0].strip().lower() == "respond-async" for p in prefer.split(","))


MAX_IDEMPOTENCY_KEY = 255


def idempotency_key(request: Request) -> str | None:
    """The `Idempotency-Key` header (Stripe's raw token, or the IETF draft's quoted string), checked."""
    raw = request.headers.get("idempotency-key")
    if raw is None:
        return None
    key = raw.strip()
    if len(key) >= 2 and key[0] == key[-1] == '"':
        key = key[1:-1]
    if not 0 < len(key) <= MAX_IDEMPOTENCY_KEY or not all(" " <= c <= "~" for c in key):
        raise InvalidInput(f"Idempotency-Key: must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters")
    return key


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work` (a request to the serving core) unless the client disconnects first: then it is
    cancelled, which withdraws the request from its instance, and Cancelled is raised.

    Starlette does not cancel a handler whose client left; without this an abandoned request would keep
    its instance busy until it finished on its own. The work runs in the handler's own task (a watcher
    task cancels it), so the usual path costs one task, not two."""
    handler = asyncio.current_task()
    assert handler is not None
    gone = asyncio.Event()
    watcher = asyncio.ensure_future(_cancel_on_disconnect(request, handler, gone))
    try:
        return await work
    except asyncio.CancelledError:
        if gone.is_set():
            handler.uncancel()
            raise Cancelled(f"{request.method} {request.url.path}: the client disconnected") from None
        raise
    finally:
        watcher.cancel()


async def _cancel_on_disconnect(request: Request, handler: asyncio.Task[Any], gone: asyncio.Event) -> None:
    # The body has been read: the next message the server has for this request is its disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.set()
    handler.cancel()


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a worker thread for `size` bytes past OFF_LOOP_BYTES (else here); past ONE_AT_A_TIME_BYTES one
    such call at a time, the others waiting on the event loop (holding no worker thread)."""
    if size < OFF_LOOP_BYTES:
        return fn(*args)
    if size < ONE_AT_A_TIME_BYTES:
        return await anyio.to_thread.run_sync(functools.partial(fn, *args))
    async with _one_at_a_time():
        # Not cancelled while fn runs (anyio waits for the thread): the next call cannot start beside this one.
        return await anyio.to_thread.run_sync(functools.partial(fn, *args))


# Work on a large body holds copies of it while it runs (a JSON parse: the document decoded whole, then its
# strings), and the GIL lets no two such calls run faster than one: run one at a time, so that only one body's
# copies are held at once (six 60 MB bodies parsed together held four documents beside their strings).
ONE_AT_A_TIME_BYTES = 4 * 1024 * 1024
_ONE_AT_A_TIME: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def _one_at_a_time() -> asyncio.Semaphore:
    """The running loop's semaphore for large bodies (one per loop: a process may run several, as tests do)."""
    loop = asyncio.get_running_loop()
    semaphore = _ONE_AT_A_TIME.get(loop)
    if semaphore is None:
        semaphore = _ONE_AT_A_TIME[loop] = asyncio.Semaphore(1)
    return semaphore
