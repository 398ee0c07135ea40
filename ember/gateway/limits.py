"""Request body limits: refuse an oversized body before and while it streams in, and after inflating it; admit
bodies by the bytes the whole gateway holds at once; give up on a body that stops coming.

The gateway's memory is bounded by what it admits, not by its clients: every body's bytes are counted against
one `BodyBudget` as they arrive (a declared Content-Length is claimed whole, before a byte is read), and held
until the request is answered. A body that would take the budget past its limit is refused with 429 and
Retry-After (one over the per-request limit is a 413 instead, whatever the budget); one that sends nothing for
`body_timeout_s` is a 408.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import AsyncIterator

from starlette.requests import Request

from ember.errors import InvalidInput, Overloaded, PayloadTooLarge, RequestTimeout
from ember.gateway.context import gateway_of, off_loop

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_INFLIGHT_BYTES = 256 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0


class BodyBudget:
    """Bytes of request bodies the gateway holds at once, over all requests (one event loop: no lock)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_inflight_bytes: must be at least 1, got {limit}")
        self.limit, self.held = limit, 0

    def claim(self, request: Request, total: int) -> None:
        """Grow this request's claim to `total` bytes, or Overloaded when the budget has no room for it."""
        mine = getattr(request.state, "body_bytes", 0)
        if total <= mine:
            return
        if self.held + total - mine > self.limit:
            raise Overloaded(f"request bodies in flight would exceed the gateway's budget of {self.limit} bytes "
                             "(max_inflight_mb); retry shortly", retry_after=1.0)
        self.held += total - mine
        request.state.body_bytes = total

    def release(self, request: Request) -> None:
        """Hand back what the request claimed (when it has been answered)."""
        self.held -= getattr(request.state, "body_bytes", 0)
        request.state.body_bytes = 0

# wbits per Content-Encoding (tritonclient's request_compression_algorithm sends either).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def _too_large(limit: int, what: str = "request body") -> PayloadTooLarge:
    return PayloadTooLarge(f"{what} exceeds the limit of {limit} bytes (max_body_bytes)")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole (inflated) body, or PayloadTooLarge as soon as it is known to exceed `limit`, Overloaded when the
    gateway's body budget cannot hold it, RequestTimeout when it stalls."""
    gateway = gateway_of(request)
    raw = await _read_raw(request, limit, gateway.budget, gateway.body_timeout_s)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in _WBITS:
        raise InvalidInput(f"Content-Encoding: {encoding!r} is not supported (gzip, deflate, identity)")
    body = await off_loop(len(raw), _inflate, raw, encoding, limit)
    gateway.budget.claim(request, len(raw) + len(body))
    return body


async def _read_raw(request: Request, limit: int, budget: BodyBudget, timeout_s: float) -> bytes:
    """Content-Length is checked (and claimed from the budget) first, with no byte read; the streamed bytes are
    counted too, because a chunked body has no Content-Length and a declared one may lie."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise InvalidInput(f"Content-Length: not an integer: {declared!r}") from None
        if size > limit:
            raise _too_large(limit)
        try:
            budget.claim(request, size)
        except Overloaded:
            await _drain(request, timeout_s)
            raise
    chunks: list[bytes] = []
    received = 0
    async for chunk in _chunks(request, timeout_s):
        received += len(chunk)
        if received > limit:
            raise _too_large(limit)
        try:
            budget.claim(request, received)
        except Overloaded:
            chunks.clear()
            await _drain(request, timeout_s)
            raise
        chunks.append(chunk)
    return b"".join(chunks)


async def _drain(request: Request, timeout_s: float) -> None:
    """Read and drop the rest of a refused body (holding none of it), so that its client, still sending, reads
    the 429 rather than a reset connection; a client that stalls is left to the body timeout."""
    with contextlib.suppress(RequestTimeout):
        async for _ in _chunks(request, timeout_s):
            pass


async def _chunks(request: Request, timeout_s: float) -> AsyncIterator[bytes]:
    """The body's chunks; RequestTimeout when none comes for `timeout_s` (a slowloris holds no more than that)."""
    stream = request.stream()
    while True:
        try:
            async with asyncio.timeout(timeout_s):
                chunk = await anext(stream)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise RequestTimeout(f"request body: no data for {timeout_s:g} s (body_timeout_s); "
                                 "send the body without pausing") from None
        yield chunk


def _inflate(raw: bytes, encoding: str, limit: int) -> bytes:
    """Inflate at most limit + 1 bytes, so a small compressed bomb cannot take the memory."""
    inflater = zlib.decompressobj(_WBITS[encoding])
    try:
        body = inflater.decompress(raw, limit + 1)
    except zlib.error as err:
        raise InvalidInput(f"Content-Encoding {encoding}: corrupt body: {err}") from None
    if len(body) > limit:
        raise _too_large(limit, "inflated request body")
    if not inflater.eof:
        raise InvalidInput(f"Content-Encoding {encoding}: truncated body")
    return body
