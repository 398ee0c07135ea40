"""OpenAI text generation: `POST /v1/chat/completions` and `POST /v1/completions`, plain or streamed (SSE).

A model serves them when its contract follows the `llm` runtime's convention: one input `request` BYTES [1]
(the generation request as JSON) and outputs `text` BYTES [1], `finish_reason` BYTES [1],
`prompt_tokens` and `completion_tokens` INT64 [1], one set per reply (`ember/runtimes/llm.py`).

Streaming is SSE as OpenAI sends it: `chat.completion.chunk` (or `text_completion`) events sharing one id,
the role in the first delta, the finish reason in the last, a usage chunk with
`stream_options.include_usage`, then `data: [DONE]`. An error before the first byte is the right status
code; the gateway waits up to `HEAD_START_S` for the first reply, and if the instance comes up on a slow
rung meanwhile it starts the stream with SSE comment lines every `KEEPALIVE_S` so proxies keep the
connection, after which a failure is an in-band error event. A client that disconnects withdraws the
request from the instance. Non-streaming calls follow the `/v1` rule: no 202 without
`Prefer: respond-async` (then the job holds the V2 tensors); a streaming call never becomes a job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ember.errors import EmberError, ModelFailed
from ember.gateway.context import gateway_of, label_model, prefers_async, until_disconnected
from ember.gateway.errors import ParamError, openai_error_body, validation_message
from ember.gateway.jobs_api import accepted_response
from ember.gateway.limits import read_body
from ember.gateway.service import Service
from ember.gateway.v2_codec import parse_json_object
from ember.serving.results import InferStream, JobAccepted
from ember.wire.chat import ChatCompletionRequest, CompletionRequest
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

HEAD_START_S = 1.0     # how long a stream's status code waits for the first reply
KEEPALIVE_S = 5.0      # SSE comment lines while an instance comes up

_OUTPUTS = {"text": "BYTES", "finish_reason": "BYTES", "prompt_tokens": "INT64", "completion_tokens": "INT64"}


def llm_contract(service: Service, model: str) -> ModelContract:
    name, _, version = model.partition(":")
    contract = service.contract(name, version or None)
    spec = contract.input("request")
    outputs = {o.name: o.datatype for o in contract.outputs}
    if len(contract.inputs) != 1 or spec is None or spec.datatype != "BYTES" or \
            any(outputs.get(k) != v for k, v in _OUTPUTS.items()):
        raise ParamError(f"model: '{model}' is not a text-generation model (needs input 'request' BYTES [1] and "
                         "outputs text, finish_reason BYTES and prompt_tokens, completion_tokens INT64)", "model")
    return contract


def _parse(raw: bytes, model: type[BaseModel], where: str) -> Any:
    data = parse_json_object(raw, "the request body")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        message, param = validation_message(err, where)
        raise ParamError(message, param) from None


class _Shape:
    """How one API writes a completion, whole or chunk by chunk."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _base(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finish: str, usage: dict[str, int]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._base(False), "choices": [choice], "usage": usage}

    def chunk(self, text: str | None, finish: str | None, *, first: bool = False,
              usage: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        out = {**self._base(True), "choices": [choice]}
        if usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._base(True), "choices": [], "usage": usage}


def _reply(outputs: Tensors) -> tuple[str, str, dict[str, int]]:
    """(text, finish reason, usage) of one reply, or of every reply collected into one answer."""
    try:
        text = b"".join(bytes(t) for t in outputs["text"].reshape(-1)).decode("utf-8", errors="replace")
        finishes = [bytes(f).decode() for f in outputs["finish_reason"].reshape(-1) if bytes(f)]
        prompt, completion = int(np.max(outputs["prompt_tokens"])), int(np.max(outputs["completion_tokens"]))
    except (KeyError, ValueError, TypeError) as err:
        raise ModelFailed(f"the model's reply does not follow the text-generation convention: {err}") from None
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return text, finishes[-1] if finishes else "", usage


def _request_tensor(body: dict[str, Any]) -> Tensors:
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps(body).encode()
    return {"request": arr}


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def _generate(request: Request, *, chat: bool) -> Response:
    gateway = gateway_of(request)
    raw = await read_body(request, gateway.max_body_bytes)
    kind: type[ChatCompletionRequest | CompletionRequest] = ChatCompletionRequest if chat else CompletionRequest
    req = _parse(raw, kind, "chat completion request" if chat else "completion request")
    contract = llm_contract(gateway.service, req.model)
    label_model(request, contract.name)
    inputs = _request_tensor(req.generation_request())
    shape = _Shape(chat, req.model)
    if req.stream:
        return await _stream(request, gateway.service, contract, inputs, shape, req.include_usage)
    work = gateway.service.infer(contract, inputs, respond_async=prefers_async(request), when_full="reject")
    result = await until_disconnected(request, work)
    if isinstance(result, JobAccepted):
        return accepted_response(contract, result)
    text, finish, usage = _reply(result.outputs)
    return JSONResponse(shape.whole(text, finish, usage),
                        headers={"Ember-Rung": result.rung.value, "Ember-Instance": result.instance_id})


async def _stream(request: Request, service: Service, contract: ModelContract, inputs: Tensors, shape: _Shape,
                  include_usage: bool) -> Response:
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
    events = _events(opening, shape, include_usage)
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


def _discard(opening: asyncio.Future[InferStream]) -> None:
    """Nobody will read this stream: withdraw its request, whether it is still opening or open already."""
    if not opening.done():
        opening.cancel()
    elif not opening.cancelled() and opening.exception() is None:
        opening.result().on_close()


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def _events(opening: asyncio.Future[InferStream], shape: _Shape, include_usage: bool) -> AsyncIterator[str]:
    stream: InferStream | None = None
    try:
        while not opening.done():
            yield ": waiting for an instance to come up\n\n"
            await asyncio.wait((opening,), timeout=KEEPALIVE_S)
        stream = opening.result()
        yield ": ember-rung " + stream.rung.value + "\n\n"
        yield _sse(shape.chunk(None, None, first=True, usage=include_usage))
        finish, usage = "", dict[str, int]()
        async for outputs in stream:
            text, finish, usage = _reply(outputs)
            if text:
                yield _sse(shape.chunk(text, None, usage=include_usage))
        yield _sse(shape.chunk(None, finish or "stop", usage=include_usage))
        if include_usage:
            yield _sse(shape.usage_chunk(usage))
        yield _sse("[DONE]")
    except EmberError as err:
        yield _sse(openai_error_body(err))   # after the first byte a failure can only be an event
    finally:
        _discard(opening)
        if stream is not None:
            stream.on_close()   # synchronous: a disconnect cancels this generator at its next await
            with contextlib.suppress(BaseException):
                await stream.aclose()
