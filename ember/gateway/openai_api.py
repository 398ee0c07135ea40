"""OpenAI-compatible endpoints: `GET /v1/models`, `GET /v1/models/{id}` and `POST /v1/embeddings`.

`GET /v1/models/{id}` answers the model's card (`id` a name or a `name:version` key), or 404 `model_not_found` in
OpenAI's error shape.

Embedding-model convention: a model serves /v1/embeddings when its contract has exactly
one input `text` BYTES [-1] (one UTF-8 string per row) and an output `embedding` FP32
[-1, D]; an optional output `token_count` INT64 [-1] gives each row's token count, summed
into `usage` (without it usage reports 0 tokens). Any other model answers 400 naming
`model`. `dimensions` is accepted only when it equals D (ember does not truncate).
`encoding_format: base64` is the little-endian float32 bytes of each vector, as OpenAI's.
`model` is a model name ("name", latest version) or a "name:version" key.

No room in any instance: the request waits (up to the server's `overload_wait_s`), then answers
429 with `Retry-After` (the queue's expected wait), which OpenAI clients retry by themselves; they
cannot follow a 202. With `Prefer: respond-async` it becomes a durable job instead: 202 Accepted with
`Location: /v2/jobs/{id}` and `Retry-After`; the finished job holds the V2 tensors (`embedding`,
`token_count`), not the OpenAI shape.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.errors import ModelFailed
from ember.gateway.context import gateway_of, idempotency_key, label_model, off_loop, prefers_async, until_disconnected
from ember.gateway.errors import ParamError, validation_message
from ember.gateway.jobs_api import accepted_response
from ember.gateway.limits import read_body
from ember.gateway.service import Service
from ember.gateway.v2_codec import parse_json_object
from ember.serving.results import JobAccepted
from ember.wire.contract import ModelContract
from ember.wire.openai import Embedding, EmbeddingRequest, EmbeddingResponse, ModelCard, ModelList, Usage
from ember.wire.tensors import Tensors

MAX_INPUTS = 2048  # OpenAI's own limit on strings per request


async def list_models(request: Request) -> Response:
    gateway = gateway_of(request)
    names = sorted({c.name for c in gateway.service.contracts()})
    cards = [ModelCard(id=name, created=gateway.started_at) for name in names]
    return JSONResponse(ModelList(data=cards).model_dump())


async def get_model(request: Request) -> Response:
    gateway = gateway_of(request)
    model = request.path_params["model"]
    name, _, version = model.partition(":")
    contract = gateway.service.contract(name, version or None)   # ModelNotFound: 404 model_not_found
    label_model(request, contract.key)
    return JSONResponse(ModelCard(id=model, created=gateway.started_at).model_dump())


def parse_request(raw: bytes) -> EmbeddingRequest:
    data = parse_json_object(raw, "the request body")
    try:
        return EmbeddingRequest.model_validate(data)
    except ValidationError as err:
        message, param = validation_message(err, "embeddings request")
        raise ParamError(message, param) from None


def texts_of(value: Any) -> list[str]:
    """`input` as a list of non-empty strings; token-id arrays are refused by name."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise ParamError(f"input: must be a string or a list of strings, got {type(value).__name__}", "input")
    if not items:
        raise ParamError("input: must not be an empty list", "input")
    if len(items) > MAX_INPUTS:
        raise ParamError(f"input: at most {MAX_INPUTS} strings per request, got {len(items)}", "input")
    for i, item in enumerate(items):
        if isinstance(item, int | list) and not isinstance(item, bool):
            raise ParamError("input: token-id arrays are not supported; send the text as a string "
                             "or a list of strings", "input")
        if not isinstance(item, str):
            raise ParamError(f"input[{i}]: must be a string, got {type(item).__name__}", "input")
        if not item:
            raise ParamError(f"input[{i}]: must not be an empty string", "input")
    return items


def embedding_contract(service: Service, model: str) -> ModelContract:
    """The model, if it follows the embedding convention (see the module docstring)."""
    name, _, version = model.partition(":")
    contract = service.contract(name, version or None)
    text = contract.input("text")
    outputs = {o.name: o for o in contract.outputs}
    emb, count = outputs.get("embedding"), outputs.get("token_count")
    follows = (
        len(contract.inputs) == 1 and text is not None and text.datatype == "BYTES" and text.shape == (-1,)
        and emb is not None and emb.datatype == "FP32" and len(emb.shape) == 2
        and (count is None or (count.datatype == "INT64" and count.shape == (-1,)))
    )
    if not follows:
        raise ParamError(f"model: '{model}' is not an embedding model (needs input 'text' BYTES [-1] and output "
                         "'embedding' FP32 [-1, D], optionally 'token_count' INT64 [-1])", "model")
    return contract


def _check_dimensions(requested: int | None, dim: int, model: str) -> None:
    if requested is not None and dim != -1 and requested != dim:
        raise ParamError(f"dimensions: model '{model}' returns {dim}-dimensional embeddings; "
                         f"dimensions={requested} is not supported", "dimensions")


def _bytes_tensor(texts: list[str]) -> np.ndarray:
    arr = np.empty(len(texts), dtype=object)
    arr[:] = [t.encode("utf-8") for t in texts]
    return arr


def build_response(req: EmbeddingRequest, contract: ModelContract, n: int, outputs: Tensors) -> bytes:
    emb = outputs.get("embedding")
    if emb is None or emb.ndim != 2 or emb.shape[0] != n:
        shape = None if emb is None else list(emb.shape)
        raise ModelFailed(f"model '{contract.key}': output 'embedding' has shape {shape}, expected [{n}, D]")
    _check_dimensions(req.dimensions, emb.shape[1], req.model)
    vectors = np.asarray(emb, dtype="<f4")
    data = [Embedding(index=i, embedding=_encode(vec, req.encoding_format)) for i, vec in enumerate(vectors)]
    counts = outputs.get("token_count")
    tokens = int(np.sum(counts)) if counts is not None else 0
    body = EmbeddingResponse(data=data, model=req.model, usage=Usage(prompt_tokens=tokens, total_tokens=tokens))
    return body.model_dump_json().encode()


def _encode(vec: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vec.tobytes()).decode("ascii")
    return vec.tolist()


async def embeddings(request: Request) -> Response:
    gateway = gateway_of(request)
    raw = await read_body(request, gateway.max_body_bytes)
    with gateway.tracer.start("decode"):
        req = await off_loop(len(raw), parse_request, raw)
        texts = texts_of(req.input)
    contract = embedding_contract(gateway.service, req.model)
    label_model(request, contract.key)
    _check_dimensions(req.dimensions, _dim(contract), req.model)
    # OpenAI clients cannot follow a 202: without `Prefer: respond-async` a full model answers 429 (which
    # they retry on their own, after Retry-After) once no room came within the server's overload wait.
    work = gateway.service.infer(contract, {"text": _bytes_tensor(texts)}, respond_async=prefers_async(request),
                                 idempotency_key=idempotency_key(request),
                                 when_full="reject")
    result = await until_disconnected(request, work)
    if isinstance(result, JobAccepted):
        return accepted_response(contract, result)
    size = sum(a.nbytes for a in result.outputs.values())
    with gateway.tracer.start("encode"):
        payload = await off_loop(size, build_response, req, contract, len(texts), result.outputs)
    return Response(payload, media_type="application/json",
                    headers={"Ember-Rung": result.rung.value, "Ember-Instance": result.instance_id})


def _dim(contract: ModelContract) -> int:
    return next(o.shape[1] for o in contract.outputs if o.name == "embedding")
