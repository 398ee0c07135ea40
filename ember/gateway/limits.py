"""Request body limits: refuse an oversized body before and while it streams in, and after inflating it; admit
bodies by the bytes the whole gateway holds at once; give up on a body that stops coming.

The gateway's memory is bounded by what it admits, not by its clients: every body's bytes are counted against
one `BodyBudget` as they arrive (a declared Content-Length is claimed whole, before a byte is read), and held
until the request is answered. A body that would take the budget past its limit is refused with 429 and
Retry-After (one over the per-request limit is a 413 instead, whatever the budget); one that sends nothing for
`body_timeout_s` is a 408.

A trickle (a byte every few seconds) would reset that timeout forever while its declared Content-Length holds
the budget, so a body must also keep a minimum average rate (`body_min_rate`, bytes/s, counted after the first
`BODY_RATE_GRACE_S`) and arrive whole within `body_deadline_s`; either missed is a 408 naming the setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import io
import re
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.requests import Request

from ember.errors import InvalidInput, Overloaded, PayloadTooLarge, RequestTimeout
from ember.gateway.context import gateway_of, off_loop

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_INFLIGHT_BYTES = 256 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_BODY_MIN_RATE = 64 * 1024          # bytes/s, on average, after the grace
DEFAULT_BODY_DEADLINE_S = 120.0
BODY_RATE_GRACE_S = 10.0                   # a connection's first seconds (slow start, a client's own set-up)


@dataclass(frozen=True)
class BodyPace:
    """How slowly a body may come: the longest pause, the least average rate (0: none) and the whole time."""

    timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    min_rate: float = DEFAULT_BODY_MIN_RATE
    deadline_s: float = DEFAULT_BODY_DEADLINE_S
    grace_s: float = BODY_RATE_GRACE_S

    def wait(self, elapsed: float, received: int) -> tuple[float, str]:
        """How long to wait for the next chunk, `elapsed` s into the body with `received` bytes, and the 408's
        message if none comes by then."""
        waits = [(self.timeout_s, f"request body: no data for {self.timeout_s:g} s (body_timeout_s); "
                                  "send the body without pausing"),
                 (self.deadline_s - elapsed, f"request body: not complete within {self.deadline_s:g} s "
                                             f"(body_deadline_s); {received} bytes came")]
        if self.min_rate > 0:
            waits.append((self.grace_s + received / self.min_rate - elapsed,
                          f"request body: {received} bytes in {elapsed:.1f} s, under the minimum rate of "
                          f"{self.min_rate:g} bytes/s (body_min_rate_kbs)"))
        return min(waits, key=lambda w: w[0])

    def whole_s(self, size: int) -> float:
        """How long a body of `size` bytes, its size known, may take in all: at the least rate after the grace, at
        most the deadline (a gateway link's frame, armed once for the whole of it)."""
        return min(self.deadline_s, self.grace_s + size / self.min_rate) if self.min_rate > 0 else self.deadline_s


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
        """Hand back what the request claimed (when it has been answered); a large claim's memory is handed back
        to the OS too (glibc keeps freed memory for reuse otherwise: 6 GB stayed held a minute after a burst)."""
        released = getattr(request.state, "body_bytes", 0)
        self.held -= released
        request.state.body_bytes = 0
        if released >= TRIM_BYTES and _TRIM is not None:
            with contextlib.suppress(RuntimeError):   # no running loop: nothing to trim for
                asyncio.get_running_loop().run_in_executor(None, _TRIM, 0)

TRIM_BYTES = 16 * 1024 * 1024


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim   # glibc only
        return trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()

# wbits per Content-Encoding (tritonclient's request_compression_algorithm sends either).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def _too_large(limit: int, what: str = "request body") -> PayloadTooLarge:
    return PayloadTooLarge(f"{what} exceeds the limit of {limit} bytes (max_body_bytes)")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole (inflated) body, or PayloadTooLarge as soon as it is known to exceed `limit`, Overloaded when the
    gateway's body budget cannot hold it, RequestTimeout when it stalls."""
    gateway = gateway_of(request)
    pace = BodyPace(gateway.body_timeout_s, gateway.body_min_rate, gateway.body_deadline_s, BODY_RATE_GRACE_S)
    raw = await _read_raw(request, limit, gateway.budget, pace)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        body, held = raw, len(raw)
    elif encoding not in _WBITS:
        raise InvalidInput(f"Content-Encoding: {encoding!r} is not supported (gzip, deflate, identity)")
    else:
        body = await off_loop(len(raw), _inflate, raw, encoding, limit)
        held = len(raw) + len(body)
        gateway.budget.claim(request, held)
    await _claim_parse(request, gateway.budget, body, held)
    return body


# What parsing JSON makes of a body, per item, at most (CPython, 64-bit): an empty list or dict with its slot in
# its parent; a float (or a large int) with its slot. A body of `[[],[],...]` is 20 M lists per 60 MB.
PARSED_CONTAINER_BYTES = 72
PARSED_ITEM_BYTES = 40
# A str holds every character in the width of its widest (PEP 393): 4 bytes past the BMP (UTF-8's 4-byte sequences,
# or an escaped surrogate pair), 2 past Latin-1 (UTF-8 from U+0100 on, or a \u escape of one), else 1.
_WIDTH_4 = re.compile(rb"[\xf0-\xf4]|\\u[dD][89abAB]")
_WIDTH_2 = re.compile(rb"[\xc4-\xef]|\\u(?:0[1-9a-fA-F]|[1-9a-fA-F])")


def string_width(text: bytes) -> int:
    """The most bytes a character of `text`'s strings can take once parsed: 4, 2 or 1 (an escaped backslash before
    a `u` counts too, which only overestimates)."""
    if _WIDTH_4.search(text):
        return 4
    return 2 if _WIDTH_2.search(text) else 1


def parsed_estimate(text: bytes) -> int:
    """An upper bound, roughly, on the memory parsing `text` as JSON takes beyond one byte per character of its
    strings: containers and separated items (counted in bytes: brackets or commas inside strings count too, which
    only overestimates), and wider characters, as if every byte of the body were one, in the document's decoded copy
    while it is parsed and in its strings after (one emoji makes each copy of 60 M letters take 240 MB). The byte per
    character is not claimed: it is at most the body's bytes, so the gateway's peak stays within about twice the
    budget whatever the shape."""
    containers = text.count(b"[") + text.count(b"{")
    items = text.count(b",") + text.count(b":")
    wider = 2 * (string_width(text) - 1) * len(text)
    return PARSED_CONTAINER_BYTES * containers + PARSED_ITEM_BYTES * items + wider


async def _claim_parse(request: Request, budget: BodyBudget, body: bytes, held: int) -> None:
    """Claim what parsing the body will take, beside its bytes, from the same budget: the gateway's memory stays
    bounded by what it admits whatever the JSON's shape (413 when one body's parse could never fit)."""
    if request.headers.get("content-type", "").split(";")[0].strip().lower() == "application/octet-stream":
        head = request.headers.get("inference-header-content-length")
        body = body[: int(head)] if head is not None and head.isdigit() else b""
    if not body:
        return
    parsed = await off_loop(len(body), parsed_estimate, body)
    if parsed > budget.limit:
        raise PayloadTooLarge(f"request body: parsing it would take about {parsed} bytes, more than the gateway's "
                              f"whole budget of {budget.limit} bytes (max_inflight_mb); send large tensors as binary "
                              "(application/octet-stream) or in smaller requests")
    # At most the whole budget: a body that fits the budget alone is admitted once nothing else is held.
    budget.claim(request, min(held + parsed, budget.limit))


async def _read_raw(request: Request, limit: int, budget: BodyBudget, pace: BodyPace) -> bytes:
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
            await _drain(request, pace)
            raise
    body = _Gathered()
    async for chunk in _chunks(request, pace):
        if body.received + len(chunk) > limit:
            raise _too_large(limit)
        try:
            budget.claim(request, body.received + len(chunk))
        except Overloaded:
            del body
            await _drain(request, pace)
            raise
        body.add(chunk)
    return body.whole()


class _Gathered:
    """A body's bytes as they come, written into one growing buffer (`io.BytesIO`, whose `getvalue` hands over that
    buffer without a copy once it is the body's exact size), each chunk let go at once: a burst of 60 MB bodies
    gathered as lists of chunks and then joined held a second copy of each body as it was joined, and left some
    100 MB of chunks in the allocator's heap at its peak."""

    def __init__(self) -> None:
        self._buf = io.BytesIO()
        self.received = 0

    def add(self, chunk: bytes) -> None:
        self._buf.write(chunk)
        self.received += len(chunk)

    def whole(self) -> bytes:
        return self._buf.getvalue()


async def _drain(request: Request, pace: BodyPace) -> None:
    """Read and drop the rest of a refused body (holding none of it), so that its client, still sending, reads
    the 429 rather than a reset connection; a client that stalls or trickles is left to the body's pace."""
    with contextlib.suppress(RequestTimeout):
        async for _ in _chunks(request, pace):
            pass


async def _chunks(request: Request, pace: BodyPace) -> AsyncIterator[bytes]:
    """The body's chunks; RequestTimeout when none comes for `pace.timeout_s`, when the body falls under the
    minimum rate, or when it is not whole by the deadline (a slowloris holds no more than that)."""
    stream = request.stream()
    loop = asyncio.get_running_loop()
    start, received = loop.time(), 0
    while True:
        wait_s, why = pace.wait(loop.time() - start, received)
        if wait_s <= 0:
            raise RequestTimeout(why)
        try:
            async with asyncio.timeout(wait_s):
                chunk = await anext(stream)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise RequestTimeout(why) from None
        received += len(chunk)
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
