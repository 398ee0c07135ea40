"""Request body limits: refuse an oversized body before and while it streams in, and after inflating it."""

from __future__ import annotations

import zlib

from starlette.requests import Request

from ember.errors import InvalidInput, PayloadTooLarge
from ember.gateway.context import off_loop

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024

# wbits per Content-Encoding (tritonclient's request_compression_algorithm sends either).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def _too_large(limit: int, what: str = "request body") -> PayloadTooLarge:
    return PayloadTooLarge(f"{what} exceeds the limit of {limit} bytes (max_body_bytes)")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole (inflated) body, or PayloadTooLarge as soon as it is known to exceed `limit`."""
    raw = await _read_raw(request, limit)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in _WBITS:
        raise InvalidInput(f"Content-Encoding: {encoding!r} is not supported (gzip, deflate, identity)")
    return await off_loop(len(raw), _inflate, raw, encoding, limit)


async def _read_raw(request: Request, limit: int) -> bytes:
    """Content-Length is checked first (no byte read); the streamed bytes are counted too,
    because a chunked body has no Content-Length and a declared one may lie."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise InvalidInput(f"Content-Length: not an integer: {declared!r}") from None
        if size > limit:
            raise _too_large(limit)
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


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
