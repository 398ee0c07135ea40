"""Server-sent events for generation streams: the status code waits briefly for the first reply, then the
replies go out as `data:` events in the shape an API asks for (`StreamShape`). Several streams (OpenAI's `n`
choices, or several prompts) open together and their replies are interleaved as they come, each with its index.

A stream's headers carry `Ember-Rung` and `Ember-Instance`. If the first reply has not come after
`HEAD_START_S` (an instance coming up on a slow rung, a long prompt's prefill), the headers go out as soon as the
ladder has decided the request's rung (the service's `on_claim`: at once if it has already; `Ember-Instance` only
if an instance holds the request by then), and at the latest after `HEADERS_BY_S` without either (a request waiting
for room, a stream served by another node); SSE comment lines every `KEEPALIVE_S` keep proxies on the connection
until the first reply, which an `: ember-rung` comment precedes. A failure after the first byte can then only be an
in-band error event. A client that disconnects cancels the generator here, which
withdraws the request from its instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ember.core.states import Rung
from ember.errors import EmberError
from ember.gateway.context import until_disconnected
from ember.gateway.service import Service
from ember.serving.results import InferStream, OnClaim
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

HEAD_START_S = 1.0     # how long a stream's status code waits for the first reply
HEADERS_BY_S = 5.0     # the headers go by then, told the rung or not: a proxy's idle timeout must not cut the stream
KEEPALIVE_S = 5.0      # SSE comment lines while an instance comes up


class StreamShape(Protocol):
    """How one API writes a generation stream as SSE text."""

    def opening(self) -> list[str]: ...

    def piece(self, outputs: Tensors, index: int = 0) -> list[str]: ...

    def closing(self) -> list[str]: ...

    def error(self, err: EmberError) -> list[str]: ...


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


class GenerationMeter(Protocol):
    """Where a stream's token timings go (`ember.metrics.Metrics`)."""

    def stream_started(self, model: str, rung: Rung, first_token_s: float) -> None: ...

    def stream_ended(self, model: str) -> None: ...

    def output_tokens(self, model: str, rung: Rung, tokens: int, seconds: float) -> None: ...

    def generated(self, model: str, usage: Mapping[str, Any]) -> None:
        """Count a finished generation's tokens (usage as OpenAI gives it: prompt_tokens, completion_tokens,
        prompt_tokens_details.cached_tokens)."""


class _Timing:
    """Time to first token, then time per token, from each reply's running `completion_tokens`."""

    def __init__(self, meter: GenerationMeter, model: str) -> None:
        self.meter, self.model, self.started = meter, model, time.perf_counter()
        self.rung: Rung | None = None
        self.last, self.tokens, self.prompt, self.cached = self.started, 0, 0, 0
        self.first = False   # a first reply came (it may count no token: an end-of-sequence token is not counted)

    def opened(self, rung: Rung) -> None:
        self.rung = rung

    def reply(self, outputs: Tensors) -> None:
        now = time.perf_counter()
        tokens = int(np.max(outputs["completion_tokens"])) if "completion_tokens" in outputs else self.tokens + 1
        self.prompt = int(np.max(outputs["prompt_tokens"])) if "prompt_tokens" in outputs else self.prompt
        self.cached = int(np.max(outputs["cached_tokens"])) if "cached_tokens" in outputs else self.cached
        if self.rung is not None and not self.first:
            self.meter.stream_started(self.model, self.rung, now - self.started)
            self.first = True
        elif self.rung is not None:
            self.meter.output_tokens(self.model, self.rung, tokens - self.tokens, now - self.last)
        self.last, self.tokens = now, tokens

    def ended(self) -> None:
        if self.first:
            self.meter.stream_ended(self.model)
        self.meter.generated(self.model, {"prompt_tokens": self.prompt, "completion_tokens": self.tokens,
                                          "prompt_tokens_details": {"cached_tokens": self.cached}})


async def stream_response(request: Request, service: Service, contract: ModelContract, inputs: Sequence[Tensors],
                          shape: StreamShape, meter: GenerationMeter) -> Response:
    """One stream per element of `inputs`, opened at once, answered as one SSE response."""
    timings = [_Timing(meter, contract.key) for _ in inputs]
    told = _Told()
    opening = asyncio.ensure_future(_open_all(service, contract, inputs, told))
    try:
        await until_disconnected(request, _head(opening, told.decided))
    except BaseException:
        _discard(opening)
        raise
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if opening.done():
        first = opening.result()[0]
        headers |= {"Ember-Rung": first.rung.value, "Ember-Instance": first.instance_id}
    else:   # no first reply yet: the stream starts, with keep-alive comments until it comes
        headers |= told.headers()
    return StreamingResponse(_events(opening, shape, timings), media_type="text/event-stream", headers=headers)


class _Told:
    """What the service told of the first stream's claim (its `on_claim`): the rung once the ladder decides it, the
    instance once one holds the request."""

    def __init__(self) -> None:
        self.rung: Rung | None = None
        self.instance_id: str | None = None
        self.decided: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def __call__(self, rung: Rung, instance_id: str | None) -> None:
        self.rung, self.instance_id = rung, instance_id   # the latest (a crashed instance's retry claims again)
        if not self.decided.done():
            self.decided.set_result(None)

    def headers(self) -> dict[str, str]:
        return {**({"Ember-Rung": self.rung.value} if self.rung is not None else {}),
                **({"Ember-Instance": self.instance_id} if self.instance_id is not None else {})}


async def _head(opening: asyncio.Future[list[InferStream]], decided: asyncio.Future[None]) -> None:
    """Until the headers can go: the streams open (their first replies in) within HEAD_START_S, or after that the
    request's rung is decided, or HEADERS_BY_S pass, or the opening fails first (raised: an error before any byte
    has its status code)."""
    await asyncio.wait((opening,), timeout=HEAD_START_S)
    if not opening.done():
        await asyncio.wait((opening, decided), timeout=max(0.0, HEADERS_BY_S - HEAD_START_S),
                           return_when=asyncio.FIRST_COMPLETED)
    if opening.done():
        opening.result()


async def _open_all(service: Service, contract: ModelContract, inputs: Sequence[Tensors],
                    on_claim: OnClaim | None = None) -> list[InferStream]:
    """Every stream open, or none: a failure (or a cancel) withdraws those that opened. `on_claim` is told the
    first stream's claim."""
    tasks = [asyncio.ensure_future(service.stream(contract, x, when_full="reject",
                                                  on_claim=on_claim if i == 0 else None))
             for i, x in enumerate(inputs)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            _discard(task)
        raise


def _discard(opening: asyncio.Future[list[InferStream]] | asyncio.Future[InferStream]) -> None:
    """Nobody will read these streams: withdraw their requests, whether still opening or open already."""
    if not opening.done():
        opening.cancel()
    elif not opening.cancelled() and opening.exception() is None:
        result = opening.result()
        for stream in result if isinstance(result, list) else [result]:
            stream.on_close()


_END = object()


async def _merged(streams: list[InferStream]) -> AsyncGenerator[tuple[int, Tensors], None]:
    """(index, reply) of every stream, in the order they come."""
    if len(streams) == 1:
        async for outputs in streams[0]:
            yield 0, outputs
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, stream: InferStream) -> None:
        try:
            async for outputs in stream:
                queue.put_nowait((index, outputs))
        except Exception as err:   # handed to the reader, which raises it
            queue.put_nowait((index, err))
        queue.put_nowait((index, _END))

    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is _END:
                left -= 1
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.wait(pumps)


async def _events(opening: asyncio.Future[list[InferStream]], shape: StreamShape,
                  timings: list[_Timing]) -> AsyncIterator[str]:
    streams: list[InferStream] = []
    try:
        while not opening.done():
            yield ": waiting for the first reply\n\n"
            await asyncio.wait((opening,), timeout=KEEPALIVE_S)
        streams = opening.result()
        for stream, timing in zip(streams, timings, strict=True):
            timing.opened(stream.rung)
        yield ": ember-rung " + streams[0].rung.value + "\n\n"
        for event in shape.opening():
            yield event
        async with contextlib.aclosing(_merged(streams)) as replies:
            async for index, outputs in replies:
                timings[index].reply(outputs)
                for event in shape.piece(outputs, index):
                    yield event
        for event in shape.closing():
            yield event
    except EmberError as err:
        for event in shape.error(err):   # after the first byte a failure can only be an event
            yield event
    finally:
        for timing in timings:
            timing.ended()
        _discard(opening)
        for stream in streams:
            stream.on_close()   # synchronous: a disconnect cancels this generator at its next await
        for stream in streams:
            with contextlib.suppress(BaseException):
                await stream.aclose()
