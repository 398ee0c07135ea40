"""The KServe V2 generate extension, as Triton defines it: `POST /v2/models/{m}[/versions/{v}]/generate`
answers `{"model_name", "model_version", "text_output", ...}`; `.../generate_stream` sends one such object per
reply as SSE `data:` events (no `[DONE]`; an error is `{"error": "..."}`). The body is
`{"text_input": str, "parameters": {max_tokens, temperature, top_p, seed, stop}}`; the model follows the
`llm` runtime's convention (see `ember.gateway.chat_api`). No 202 unless `Prefer: respond-async`.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ember.errors import EmberError
from ember.gateway.chat_api import generate_once, llm_contract, parse_request, reply_of, request_tensor
from ember.gateway.context import gateway_of, label_model
from ember.gateway.limits import read_body
from ember.gateway.sse import sse, stream_response
from ember.wire.chat import GenerateRequest
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors


class _V2Shape:
    """Each reply as Triton's generate_stream sends it."""

    def __init__(self, contract: ModelContract) -> None:
        self.contract = contract

    def body(self, text: str, finish: str, usage: dict[str, Any]) -> dict[str, Any]:
        return {"model_name": self.contract.name, "model_version": self.contract.version, "text_output": text,
                "finish_reason": finish, "prompt_tokens": usage["prompt_tokens"],
                "completion_tokens": usage["completion_tokens"]}

    def opening(self) -> list[str]:
        return []

    def piece(self, outputs: Tensors) -> list[str]:
        return [sse(self.body(*reply_of(outputs)))]

    def closing(self) -> list[str]:
        return []

    def error(self, err: EmberError) -> list[str]:
        return [sse({"error": err.message})]


async def _parsed(request: Request) -> tuple[ModelContract, Tensors]:
    gateway = gateway_of(request)
    model, version = request.path_params["model"], request.path_params.get("version")
    contract = llm_contract(gateway.service, f"{model}:{version}" if version else model)
    label_model(request, contract.key)
    raw = await read_body(request, gateway.max_body_bytes)
    with gateway.tracer.start("decode"):
        req = parse_request(raw, GenerateRequest, "generate request")
    return contract, request_tensor(contract, req.generation_request())


async def generate(request: Request) -> Response:
    contract, inputs = await _parsed(request)
    return await generate_once(request, contract, inputs, _V2Shape(contract).body)


async def generate_stream(request: Request) -> Response:
    contract, inputs = await _parsed(request)
    gateway = gateway_of(request)
    return await stream_response(request, gateway.service, contract, inputs, _V2Shape(contract), gateway.metrics)
