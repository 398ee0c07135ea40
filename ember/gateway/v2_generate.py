"""The KServe V2 generate extension, as Triton defines it: `POST /v2/models/{m}[/versions/{v}]/generate`
answers `{"model_name", "model_version", "text_output", ...}`; `.../generate_stream` sends one such object per
reply as SSE `data:` events (no `[DONE]`; an error is `{"error": "..."}`). The body is
`{"text_input": str, "parameters": {max_tokens, temperature, top_p, seed, stop, logprobs, top_logprobs,
logit_bias}}`; as Triton does, other top-level fields are parameters too (the known ones taken, the rest
ignored: `ember.wire.chat.GenerateRequest`). With `logprobs` each answer carries `logprobs` (OpenAI's chat
entries). The model follows the `llm` runtime's convention (see `ember.gateway.chat_api`). No 202 unless
`Prefer: respond-async`.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ember.errors import EmberError
from ember.gateway.chat_api import check_outputs, generate_once, llm_contract, parse_request, request_tensor
from ember.gateway.chat_shape import Reply, reply_of
from ember.gateway.context import gateway_of, label_model, off_loop
from ember.gateway.limits import read_body
from ember.gateway.prompt_check import check_prompts
from ember.gateway.sse import sse, stream_response
from ember.serving.results import client_message
from ember.wire.chat import GenerateRequest
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors


class _V2Shape:
    """Each reply as Triton's generate_stream sends it."""

    def __init__(self, contract: ModelContract, logprobs: bool = False) -> None:
        self.contract, self.logprobs = contract, logprobs

    def body(self, reply: Reply) -> dict[str, Any]:
        out = {"model_name": self.contract.name, "model_version": self.contract.version, "text_output": reply.text,
               "finish_reason": reply.finish, "prompt_tokens": reply.usage["prompt_tokens"],
               "completion_tokens": reply.usage["completion_tokens"]}
        if self.logprobs and reply.logprobs is not None:
            out["logprobs"] = reply.logprobs
        return out

    def whole(self, replies: list[Reply]) -> dict[str, Any]:
        return self.body(replies[0])

    def opening(self) -> list[str]:
        return []

    def piece(self, outputs: Tensors, index: int = 0) -> list[str]:
        return [sse(self.body(reply_of(outputs)))]

    def closing(self) -> list[str]:
        return []

    def error(self, err: EmberError) -> list[str]:
        return [sse({"error": client_message(err)})]


async def _parsed(request: Request) -> tuple[ModelContract, Tensors, _V2Shape]:
    gateway = gateway_of(request)
    model, version = request.path_params["model"], request.path_params.get("version")
    contract = llm_contract(gateway.service, f"{model}:{version}" if version else model)
    label_model(request, contract.key)
    raw = await read_body(request, gateway.max_body_bytes)
    with gateway.tracer.start("decode"):
        req: GenerateRequest = await off_loop(len(raw), parse_request, raw, GenerateRequest, "generate request")
        del raw   # parsed: what it held is in `req` now
    logprobs = bool(req.parameters.logprobs)
    check_outputs(contract, logprobs=logprobs, tools=False)
    inputs = request_tensor(contract, req.generation_request(), "text_input")
    await check_prompts(contract, [inputs])
    return contract, inputs, _V2Shape(contract, logprobs)


async def generate(request: Request) -> Response:
    contract, inputs, shape = await _parsed(request)
    return await generate_once(request, contract, [inputs], shape.whole)


async def generate_stream(request: Request) -> Response:
    contract, inputs, shape = await _parsed(request)
    gateway = gateway_of(request)
    return await stream_response(request, gateway.service, contract, [inputs], shape, gateway.metrics)
