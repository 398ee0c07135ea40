"""Open Inference Protocol (KServe V2) endpoints: health, metadata, infer, model repository."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import ember
from ember.errors import InvalidInput, ModelNotReady
from ember.gateway.chat_shape import generates_text, one_row
from ember.gateway.context import gateway_of, idempotency_key, label_model, off_loop, prefers_async, until_disconnected
from ember.gateway.errors import validated
from ember.gateway.jobs_api import accepted_response
from ember.gateway.limits import read_body
from ember.gateway.model_config import triton_config
from ember.gateway.prompt_check import check_prompts
from ember.gateway.v2_codec import HEADER_LENGTH, encode_infer_response, parse_infer, parse_json_object
from ember.serving.results import JobAccepted
from ember.wire.contract import ModelContract, TensorSpec
from ember.wire.tensors import validate_inputs
from ember.wire.v2 import (
    ModelMetadata,
    RepositoryIndexRequest,
    RepositoryLoadRequest,
    RepositoryModel,
    ServerMetadata,
    TensorMetadata,
)

EXTENSIONS = ["binary_tensor_data", "model_repository", "model_configuration", "ember_async_jobs"]


async def server_metadata(request: Request) -> Response:
    return JSONResponse(ServerMetadata(name="ember", version=ember.__version__, extensions=EXTENSIONS).model_dump())


async def live(request: Request) -> Response:
    return JSONResponse({"live": True})


async def ready(request: Request) -> Response:
    if not gateway_of(request).service.server_ready():
        raise ModelNotReady("server is not ready: some deployed model cannot take a request yet")
    return JSONResponse({"ready": True})


def _contract(request: Request) -> ModelContract:
    contract = gateway_of(request).service.contract(request.path_params["model"], request.path_params.get("version"))
    label_model(request, contract.key)
    return contract


def _tensor_metadata(specs: tuple[TensorSpec, ...]) -> list[TensorMetadata]:
    return [TensorMetadata(name=t.name, datatype=t.datatype, shape=list(t.shape)) for t in specs]


async def model_metadata(request: Request) -> Response:
    contract = _contract(request)
    versions = sorted({c.version for c in gateway_of(request).service.contracts() if c.name == contract.name})
    meta = ModelMetadata(name=contract.name, versions=versions or [contract.version], platform=contract.runtime,
                         inputs=_tensor_metadata(contract.inputs), outputs=_tensor_metadata(contract.outputs))
    return JSONResponse(meta.model_dump())


async def model_config(request: Request) -> Response:
    """Triton's model configuration extension (`ember.gateway.model_config`)."""
    return JSONResponse(triton_config(_contract(request)))


async def model_ready(request: Request) -> Response:
    contract = _contract(request)
    if not gateway_of(request).service.model_ready(contract.name, contract.version):
        raise ModelNotReady(f"model '{contract.key}': not ready")
    return JSONResponse({"name": contract.name, "version": contract.version, "ready": True})


async def infer(request: Request) -> Response:
    gateway = gateway_of(request)
    contract = _contract(request)
    body = await read_body(request, gateway.max_body_bytes)
    with gateway.tracer.start("decode"):
        parsed = await off_loop(len(body), parse_infer, body, request.headers.get(HEADER_LENGTH), contract)
        validate_inputs(contract, parsed.inputs)
    await check_prompts(contract, [parsed.inputs])   # what the instance would refuse at once: a 400, not a 202
    work = gateway.service.infer(contract, parsed.inputs, respond_async=prefers_async(request),
                                 idempotency_key=idempotency_key(request))
    result = await until_disconnected(request, work)
    if isinstance(result, JobAccepted):
        return accepted_response(contract, result)
    # A text generation answers its declared one row (the whole text), not a row per streamed reply.
    outputs = one_row(result.outputs) if generates_text(contract) else result.outputs
    size = sum(a.nbytes for a in outputs.values())
    with gateway.tracer.start("encode"):
        payload, header_length = await off_loop(size, encode_infer_response, contract, parsed, outputs)
    headers = {"Ember-Rung": result.rung.value, "Ember-Instance": result.instance_id}
    if header_length is None:
        return Response(payload, media_type="application/json", headers=headers)
    headers[HEADER_LENGTH] = str(header_length)
    return Response(payload, media_type="application/octet-stream", headers=headers)


M = TypeVar("M", bound=BaseModel)


async def _optional_body(request: Request, model: type[M], where: str) -> M:
    """An optional JSON body (tritonclient sends an empty one to the index endpoint)."""
    raw = await read_body(request, gateway_of(request).max_body_bytes)
    data: dict[str, Any] = await off_loop(len(raw), parse_json_object, raw, where) if raw.strip() else {}
    return validated(model, data, where)


async def repository_index(request: Request) -> Response:
    query = await _optional_body(request, RepositoryIndexRequest, "repository index request")
    entries = [RepositoryModel(name=e.name, version=e.version, state=e.state, reason=e.reason).model_dump()
               for e in gateway_of(request).service.repository_index() if not query.ready or e.state == "READY"]
    return JSONResponse(entries)


async def load(request: Request) -> Response:
    query = await _optional_body(request, RepositoryLoadRequest, "load request")
    overrides = [k for k in query.parameters if k == "config" or k.startswith("file:")]
    if overrides:
        raise InvalidInput(f"load request: parameters.{overrides[0]}: overriding a model's config or files is not "
                           "supported; ember loads the deployed contract")
    await gateway_of(request).service.load_model(request.path_params["model"])
    return JSONResponse({})


async def unload(request: Request) -> Response:
    await _optional_body(request, RepositoryLoadRequest, "unload request")
    await gateway_of(request).service.unload_model(request.path_params["model"])
    return JSONResponse({})
