"""Request body limits: refuse an oversized body before and while it streams in."""

from __future__ import annotations

from starlette.requests import Request

from ember.errors import InvalidInput, PayloadTooLarge

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body exceeds the limit of {limit} bytes (max_body_bytes)")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or PayloadTooLarge as soon as it is known to exceed `limit`.

    Content-Length is checked first (no byte read); the streamed bytes are counted too,
    because a chunked body has no Content-Length and a declared one may lie.
    """
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
