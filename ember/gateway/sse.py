"""Server-sent events for generation streams: the status code waits briefly for the first reply, then the
replies go out as `data:` events in the shape an API asks for (`StreamShape`).

If the instance is still coming up on a slow rung after `HEAD_START_S`, the stream starts anyway with SSE
comment lines every `KEEPALIVE_S` so proxies keep the connection; a failure after the first byte can then
only be an in-band error event. A client that disconnects cancels the generator here, which withdraws the
request from its instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ember.errors import EmberError
from ember.gateway.context import until_disconnected
from ember.gateway.service import Service
from ember.serving.results import InferStream
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

HEAD_START_S = 1.0     # how long a stream's status code waits for the first reply
KEEPALIVE_S = 5.0      # SSE comment lines while an instance comes up


class StreamShape(Protocol):
    """How one API writes a generation stream as SSE text."""

    def opening(self) -> list[str]: ...

    def piece(self, outputs: Tensors) -> list[str]: ...

    def closing(self) -> list[str]: ...

    def error(self, err: EmberError) -> list[str]: ...


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def stream_response(request: Request, service: Service, contract: ModelContract, inputs: Tensors,
                          shape: StreamShape) -> Response:
    opening = asyncio.ensure_future(service.stream(contract, inputs, when_full="reject"))
    try:
        await until_disconnected(request, asyncio.wait_for(asyncio.shield(opening), HEAD_START_S))
    except TimeoutError:
        pass   # a slow rung: start the stream now, with keep-alive comments until the first reply
    except BaseException:
        _discard(opening)
        raise
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if opening.done():
        stream = opening.result()   # an error before any byte: the right status code
        headers.update({"Ember-Rung": stream.rung.value, "Ember-Instance": stream.instance_id})
    return StreamingResponse(_events(opening, shape), media_type="text/event-stream", headers=headers)


def _discard(opening: asyncio.Future[InferStream]) -> None:
    """Nobody will read this stream: withdraw its request, whether it is still opening or open already."""
    if not opening.done():
        opening.cancel()
    elif not opening.cancelled() and opening.exception() is None:
        opening.result().on_close()


async def _events(opening: asyncio.Future[InferStream], shape: StreamShape) -> AsyncIterator[str]:
    stream: InferStream | None = None
    try:
        while not opening.done():
            yield ": waiting for an instance to come up\n\n"
            await asyncio.wait((opening,), timeout=KEEPALIVE_S)
        stream = opening.result()
        yield ": ember-rung " + stream.rung.value + "\n\n"
        for event in shape.opening():
            yield event
        async for outputs in stream:
            for event in shape.piece(outputs):
                yield event
        for event in shape.closing():
            yield event
    except EmberError as err:
        for event in shape.error(err):   # after the first byte a failure can only be an event
            yield event
    finally:
        _discard(opening)
        if stream is not None:
            stream.on_close()   # synchronous: a disconnect cancels this generator at its next await
            with contextlib.suppress(BaseException):
                await stream.aclose()
