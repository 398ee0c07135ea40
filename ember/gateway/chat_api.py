"""OpenAI text generation: `POST /v1/chat/completions` and `POST /v1/completions`, plain or streamed (SSE).

A model serves them when its contract follows the `llm` runtime's convention: one input `request` BYTES [1]
(the generation request as JSON) and outputs `text` BYTES [1], `finish_reason` BYTES [1],
`prompt_tokens` and `completion_tokens` INT64 [1], one set per reply (`ember/runtimes/llm.py`).

Streaming is SSE as OpenAI sends it (`ember.gateway.sse`): `chat.completion.chunk` (or `text_completion`)
events sharing one id, the role in the first delta, the finish reason in the last, a usage chunk with
`stream_options.include_usage`, then `data: [DONE]`. Non-streaming calls follow the `/v1` rule: no 202 without
`Prefer: respond-async` (then the job holds the V2 tensors); a streaming call never becomes a job.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.errors import EmberError, ModelFailed
from ember.gateway.context import gateway_of, idempotency_key, label_model, prefers_async, until_disconnected
from ember.gateway.errors import ParamError, openai_error_body, validation_message
from ember.gateway.jobs_api import accepted_response
from ember.gateway.limits import read_body
from ember.gateway.service import Service
from ember.gateway.sse import sse, stream_response
from ember.gateway.v2_codec import parse_json_object
from ember.serving.results import JobAccepted
from ember.wire.chat import ChatCompletionRequest, CompletionRequest
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

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


def parse_request(raw: bytes, model: type[BaseModel], where: str) -> Any:
    data = parse_json_object(raw, "the request body")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        message, param = validation_message(err, where)
        raise ParamError(message, param) from None


class _Shape:
    """How one OpenAI API writes a completion, whole or chunk by chunk (a `StreamShape`)."""

    def __init__(self, chat: bool, model: str, include_usage: bool = False) -> None:
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._finish, self._usage = "", dict[str, Any]()

    def opening(self) -> list[str]:
        return [sse(self.chunk(None, None, first=True, usage=self.include_usage))]

    def piece(self, outputs: Tensors) -> list[str]:
        text, self._finish, self._usage = reply_of(outputs)
        return [sse(self.chunk(text, None, usage=self.include_usage))] if text else []

    def closing(self) -> list[str]:
        out = [sse(self.chunk(None, self._finish or "stop", usage=self.include_usage))]
        if self.include_usage:
            out.append(sse(self.usage_chunk(self._usage)))
        return [*out, sse("[DONE]")]

    def error(self, err: EmberError) -> list[str]:
        return [sse(openai_error_body(err))]

    def _base(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finish: str, usage: dict[str, Any]) -> dict[str, Any]:
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

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._base(True), "choices": [], "usage": usage}


def reply_of(outputs: Tensors) -> tuple[str, str, dict[str, Any]]:
    """(text, finish reason, usage) of one reply, or of every reply collected into one answer."""
    try:
        text = b"".join(bytes(t) for t in outputs["text"].reshape(-1)).decode("utf-8", errors="replace")
        finishes = [bytes(f).decode() for f in outputs["finish_reason"].reshape(-1) if bytes(f)]
        prompt, completion = int(np.max(outputs["prompt_tokens"])), int(np.max(outputs["completion_tokens"]))
    except (KeyError, ValueError, TypeError) as err:
        raise ModelFailed(f"the model's reply does not follow the text-generation convention: {err}") from None
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
    if "cached_tokens" in outputs:   # OpenAI's name for prompt tokens served from the prefix cache
        usage["prompt_tokens_details"] = {"cached_tokens": int(np.max(outputs["cached_tokens"]))}
    return text, finishes[-1] if finishes else "", usage


def request_tensor(contract: ModelContract, body: dict[str, Any]) -> Tensors:
    """The generation request as the `request` input, within the contract's `limits.max_tokens`."""
    cap = contract.limits.max_tokens
    if body.get("max_tokens", 0) > cap:
        raise ParamError(f"max_tokens: {body['max_tokens']} exceeds the limit of {cap} "
                         f"(limits.max_tokens of model '{contract.name}')", "max_tokens")
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
    with gateway.tracer.start("decode"):
        req = parse_request(raw, kind, "chat completion request" if chat else "completion request")
    contract = llm_contract(gateway.service, req.model)
    label_model(request, contract.key)
    inputs = request_tensor(contract, req.generation_request())
    shape = _Shape(chat, req.model, req.include_usage)
    if req.stream:
        return await stream_response(request, gateway.service, contract, inputs, shape, gateway.metrics)
    return await generate_once(request, contract, inputs, shape.whole)


async def generate_once(request: Request, contract: ModelContract, inputs: Tensors,
                        shape: Callable[[str, str, dict[str, Any]], dict[str, Any]]) -> Response:
    """A generation answered whole (the OpenAI and V2 generate APIs): the `/v1` rule (a 429 when full, a 202 job
    only with `Prefer: respond-async`), the reply collected, `shape(text, finish, usage)` as the body."""
    gateway = gateway_of(request)
    work = gateway.service.infer(contract, inputs, respond_async=prefers_async(request), when_full="reject",
                                 idempotency_key=idempotency_key(request))
    result = await until_disconnected(request, work)
    if isinstance(result, JobAccepted):
        return accepted_response(contract, result)
    with gateway.tracer.start("encode"):
        text, finish, usage = reply_of(result.outputs)
        body = JSONResponse(shape(text, finish, usage),
                            headers={"Ember-Rung": result.rung.value, "Ember-Instance": result.instance_id})
    gateway.metrics.generated(contract.key, usage)
    return body


