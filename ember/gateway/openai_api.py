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

`input` is a string, a list of strings, a list of token ids (one input) or a list of token-id lists, as OpenAI
takes it. Token ids are a `sentence-transformers` model's own vocabulary (as vLLM takes them): each below its
vocabulary's size, at most its max_seq_length per input, embedded as they are (no [CLS]/[SEP] added); anything
else is a 400 naming `input[i][j]`. They reach the model in-band, as elements of its `text` input
(`ember.runtimes.embedding`).

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
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.errors import InvalidInput, ModelFailed
from ember.gateway.context import gateway_of, idempotency_key, label_model, off_loop, prefers_async, until_disconnected
from ember.gateway.errors import ParamError, validated
from ember.gateway.jobs_api import accepted_response
from ember.gateway.limits import read_body
from ember.gateway.prompt_check import embedding_limits
from ember.gateway.service import Service
from ember.gateway.text_limits import utf8_within
from ember.gateway.v2_codec import parse_json_object
from ember.runtimes.embedding import check_token_ids, token_ids_element
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
    return validated(EmbeddingRequest, parse_json_object(raw, "the request body"), "embeddings request")


Item = tuple[str | list[int], str]   # one input (a text or token ids) and its name in the request


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def inputs_of(value: Any) -> list[Item]:
    """`input` as its inputs, each a non-empty string or list of integers, with its name (`input`, `input[i]`)."""
    if isinstance(value, list) and value and all(_is_id(x) for x in value):
        return [(value, "input")]   # one input of token ids: its ids are input[j]
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise ParamError("input: must be a string, a list of strings, a list of token ids or a list of token-id "
                         f"lists, got {type(value).__name__}", "input")
    if not items:
        raise ParamError("input: must not be an empty list", "input")
    if len(items) > MAX_INPUTS:
        raise ParamError(f"input: at most {MAX_INPUTS} inputs per request, got {len(items)}", "input")
    kind = "strings" if isinstance(items[0], str) else "token-id lists"
    for i, item in enumerate(items):
        if kind == "strings" and not isinstance(item, str):
            raise ParamError(f"input[{i}]: must be a string (input is a list of strings), got "
                             f"{type(item).__name__}", "input")
        if kind != "strings" and not isinstance(item, list):
            raise ParamError(f"input[{i}]: must be a list of token ids (input is a list of token-id lists), got "
                             f"{type(item).__name__}", "input")
        if not item:
            raise ParamError(f"input[{i}]: must not be an empty " + ("string" if kind == "strings" else "list"),
                             "input")
        bad = next((j for j, t in enumerate(item) if not _is_id(t)), None) if isinstance(item, list) else None
        if bad is not None:
            raise ParamError(f"input[{i}][{bad}]: must be an integer token id, got {type(item[bad]).__name__}",
                             "input")
    return [(item, f"input[{i}]") for i, item in enumerate(items)]


def checked_ids(contract: ModelContract, items: list[Item]) -> None:
    """Token ids only for a `sentence-transformers` model, within its vocabulary and max_seq_length where the
    gateway can read them (else within uint32's range; its instance checks the rest)."""
    ids = [(item, where) for item, where in items if isinstance(item, list)]
    if not ids:
        return
    if contract.runtime != "sentence-transformers":
        raise ParamError(f"input: model '{contract.key}' takes text only (token ids need a model whose vocabulary "
                         "ember knows: the sentence-transformers runtime's)", "input")
    limits = embedding_limits(contract)
    for item, where in ids:
        try:
            limits.check(item, where) if limits is not None else check_token_ids(item, where)
        except InvalidInput as err:
            raise ParamError(str(err), "input") from None


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


def _bytes_tensor(contract: ModelContract, items: list[Item]) -> np.ndarray:
    """The `text` input, each text within the contract's limits.max_string_bytes (else a 400 naming it) before it
    is encoded."""
    if len(items) > contract.limits.max_batch_rows:
        raise ParamError(f"input: {len(items)} inputs exceed the limit of {contract.limits.max_batch_rows} "
                         f"(limits.max_batch_rows of model '{contract.name}')", "input")
    arr = np.empty(len(items), dtype=object)
    arr[:] = [utf8_within(contract, t, where, "text") if isinstance(t, str) else token_ids_element(t)
              for t, where in items]
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
        del raw   # parsed: what it held is in `req` now
        items = inputs_of(req.input)
    contract = embedding_contract(gateway.service, req.model)
    label_model(request, contract.key)
    _check_dimensions(req.dimensions, _dim(contract), req.model)
    checked_ids(contract, items)
    # OpenAI clients cannot follow a 202: without `Prefer: respond-async` a full model answers 429 (which
    # they retry on their own, after Retry-After) once no room came within the server's overload wait.
    work = gateway.service.infer(contract, {"text": _bytes_tensor(contract, items)},
                                 respond_async=prefers_async(request), idempotency_key=idempotency_key(request),
                                 when_full="reject")
    result = await until_disconnected(request, work)
    if isinstance(result, JobAccepted):
        return accepted_response(contract, result)
    size = sum(a.nbytes for a in result.outputs.values())
    with gateway.tracer.start("encode"):
        payload = await off_loop(size, build_response, req, contract, len(items), result.outputs)
    return Response(payload, media_type="application/json",
                    headers={"Ember-Rung": result.rung.value, "Ember-Instance": result.instance_id})


def _dim(contract: ModelContract) -> int:
    return next(o.shape[1] for o in contract.outputs if o.name == "embedding")
