"""OpenAI text generation: `POST /v1/chat/completions` and `POST /v1/completions`, plain or streamed (SSE).

A model serves them when its contract follows the `llm` runtime's convention (`docs/llm-convention.md`): one
input `request` BYTES [1] (the generation request as JSON) and outputs `text` BYTES [1], `finish_reason` BYTES
[1], `prompt_tokens` and `completion_tokens` INT64 [1], one set per reply, and optionally `cached_tokens`,
`logprobs` and `tool_calls` (asking for log-probabilities or tool calls of a model without them is a 400).
`n` choices (and several completions prompts) are one request each, sent at once (`ember.wire.chat`), their
replies joined as choices 0..n-1 (`ember.gateway.chat_shape`).

Streaming is SSE as OpenAI sends it (`ember.gateway.sse`): `chat.completion.chunk` (or `text_completion`)
events sharing one id, the role in each choice's first delta, the finish reason in its last, a usage chunk with
`stream_options.include_usage`, then `data: [DONE]`. Non-streaming calls follow the `/v1` rule: no 202 without
`Prefer: respond-async` (then the job holds the V2 tensors); a streaming call never becomes a job.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.errors import InvalidInput
from ember.gateway.chat_shape import ChatShape, CompletionShape, Reply, generates_text, reply_of
from ember.gateway.context import (
    gateway_of,
    idempotency_key,
    label_model,
    off_loop,
    prefers_async,
    until_disconnected,
)
from ember.gateway.errors import M, ParamError, validated
from ember.gateway.jobs_api import accepted_response
from ember.gateway.limits import read_body
from ember.gateway.prompt_check import check_prompts
from ember.gateway.service import Service
from ember.gateway.sse import stream_response
from ember.gateway.text_limits import check_text_length, utf8_within
from ember.gateway.v2_codec import parse_json_object
from ember.serving.results import InferResult, JobAccepted
from ember.wire.chat import ChatCompletionRequest, CompletionRequest
from ember.wire.contract import ModelContract
from ember.wire.generation import within_limit
from ember.wire.tensors import Tensors


def llm_contract(service: Service, model: str) -> ModelContract:
    name, _, version = model.partition(":")
    contract = service.contract(name, version or None)
    if not generates_text(contract):
        raise ParamError(f"model: '{model}' is not a text-generation model (needs input 'request' BYTES [1] and "
                         "outputs text, finish_reason BYTES and prompt_tokens, completion_tokens INT64)", "model")
    return contract


def parse_request(raw: bytes, model: type[M], where: str) -> M:
    return validated(model, parse_json_object(raw, "the request body"), where)


def check_outputs(contract: ModelContract, *, logprobs: bool, tools: bool) -> None:
    """Log-probabilities and tool calls need the contract's optional outputs of those names."""
    outputs = {o.name for o in contract.outputs}
    if logprobs and "logprobs" not in outputs:
        raise ParamError(f"logprobs: model '{contract.key}' does not return log-probabilities (its contract has no "
                         "output 'logprobs')", "logprobs")
    if tools and "tool_calls" not in outputs:
        raise ParamError(f"tools: model '{contract.key}' does not return tool calls (its contract has no output "
                         "'tool_calls')", "tools")


def request_tensor(contract: ModelContract, body: dict[str, Any], field: str = "messages") -> Tensors:
    """The generation request as the `request` input, within the contract's `limits.max_tokens` and
    `limits.max_string_bytes` (past it: a 400 naming `field`, the prompt's, before the request is serialized)."""
    try:
        within_limit(body.get("max_tokens"), contract.limits.max_tokens)
    except InvalidInput as err:
        raise ParamError(err.message, "max_tokens") from None
    check_text_length(contract, body, field, "request")
    arr = np.empty(1, dtype=object)
    arr[0] = utf8_within(contract, json.dumps(body), field, "request")
    return {"request": arr}


async def chat_completions(request: Request) -> Response:
    gateway = gateway_of(request)
    raw = await read_body(request, gateway.max_body_bytes)
    with gateway.tracer.start("decode"):
        req: ChatCompletionRequest = await off_loop(len(raw), parse_request, raw, ChatCompletionRequest,
                                                     "chat completion request")
        del raw   # parsed: what it held is in `req` now
    contract = llm_contract(gateway.service, req.model)
    label_model(request, contract.key)
    check_outputs(contract, logprobs=req.wants_logprobs, tools=req.calls_tools)
    inputs = [request_tensor(contract, body) for body in req.generation_requests()]
    await check_prompts(contract, inputs)
    shape = ChatShape(req.model, choices=len(inputs), per_prompt=len(inputs), include_usage=req.include_usage,
                      logprobs=req.wants_logprobs)
    if req.stream:
        return await stream_response(request, gateway.service, contract, inputs, shape, gateway.metrics)
    return await generate_once(request, contract, inputs, shape.whole)


async def completions(request: Request) -> Response:
    gateway = gateway_of(request)
    raw = await read_body(request, gateway.max_body_bytes)
    with gateway.tracer.start("decode"):
        req: CompletionRequest = await off_loop(len(raw), parse_request, raw, CompletionRequest, "completion request")
        del raw
    contract = llm_contract(gateway.service, req.model)
    label_model(request, contract.key)
    check_outputs(contract, logprobs=req.wants_logprobs, tools=False)
    inputs = [request_tensor(contract, body, "prompt") for body in req.generation_requests()]
    await check_prompts(contract, inputs)
    shape = CompletionShape(req.model, req.prompts, n=req.choices, echo=bool(req.echo), prompt_only=req.prompt_only,
                            include_usage=req.include_usage, logprobs=req.wants_logprobs)
    if req.stream:
        return await stream_response(request, gateway.service, contract, inputs, shape, gateway.metrics)
    return await generate_once(request, contract, inputs, shape.whole)


async def generate_once(request: Request, contract: ModelContract, inputs: Sequence[Tensors],
                        shape: Callable[[list[Reply]], dict[str, Any]]) -> Response:
    """A generation answered whole (the OpenAI and V2 generate APIs): the `/v1` rule (a 429 when full, a 202 job
    only with `Prefer: respond-async`, for one choice), each choice's request sent at once and its replies
    collected, `shape(replies)` as the body."""
    gateway = gateway_of(request)
    respond_async, key = prefers_async(request), idempotency_key(request)
    if respond_async and len(inputs) > 1:
        raise ParamError("n: Prefer: respond-async queues one generation as a job (n=1 and one prompt)", "n")
    results = await until_disconnected(request, _all(gateway.service, contract, inputs, respond_async, key))
    if isinstance(results[0], JobAccepted):
        return accepted_response(contract, results[0])
    with gateway.tracer.start("encode"):
        replies = [reply_of(r.outputs) for r in results if isinstance(r, InferResult)]
        body = JSONResponse(shape(replies), headers={"Ember-Rung": results[0].rung.value,
                                                     "Ember-Instance": results[0].instance_id})
    for reply in replies:
        gateway.metrics.generated(contract.key, reply.usage)
    return body


async def _all(service: Service, contract: ModelContract, inputs: Sequence[Tensors], respond_async: bool,
               key: str | None) -> list[InferResult | JobAccepted]:
    """Every choice's request at once; the first failure withdraws the others."""
    if len(inputs) == 1:
        return [await service.infer(contract, inputs[0], respond_async=respond_async, when_full="reject",
                                    idempotency_key=key)]
    tasks = [asyncio.ensure_future(service.infer(contract, x, when_full="reject",
                                                 idempotency_key=None if key is None else f"{key}#{i}"))
             for i, x in enumerate(inputs)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        for task in tasks:   # the first failure was raised; the others' are retrieved here, not logged as lost
            if not task.cancelled():
                task.exception()
