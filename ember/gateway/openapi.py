"""The OpenAPI 3.1 document served at `/openapi.json`: every route of the gateway, its bodies described by the
wire models themselves (pydantic's `model_json_schema`), so the document cannot drift from what is validated.

The one hand-written part is `_ROUTES`, the paths table: method, path, the request and response models, and the
statuses an error may take. Error bodies are V2's `{"error": str}` or OpenAI's `{"error": {...}}` by prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

import ember
from ember.wire.chat import ChatCompletionRequest, CompletionRequest, GenerateRequest
from ember.wire.openai import EmbeddingRequest, EmbeddingResponse, ErrorResponse, ModelCard, ModelList
from ember.wire.v2 import (
    ErrorBody,
    InferRequest,
    InferResponse,
    JobAcceptedBody,
    JobBody,
    ModelMetadata,
    RepositoryIndexRequest,
    RepositoryLoadRequest,
    RepositoryModel,
    ServerMetadata,
)

_REF = "#/components/schemas/{model}"
_JSON_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class _Route:
    method: str
    path: str
    summary: str
    request: type[BaseModel] | None = None
    response: type[BaseModel] | dict[str, Any] | None = None
    errors: tuple[int, ...] = ()
    media: str = "application/json"
    optional_body: bool = False


_INFER_ERRORS = (400, 404, 408, 413, 429, 500, 502, 503, 504)
_MODEL = "/v2/models/{model}"
_VERSION = "/v2/models/{model}/versions/{version}"


def _model_routes(base: str) -> list[_Route]:
    return [
        _Route("get", base, "model metadata", response=ModelMetadata, errors=(404,)),
        _Route("get", base + "/ready", "model readiness", response=_JSON_OBJECT, errors=(404, 503)),
        _Route("get", base + "/config", "the model's configuration in Triton's shape (model_config.proto)",
               response=_JSON_OBJECT, errors=(404,)),
        _Route("post", base + "/infer", "V2 inference (JSON, or a JSON header and binary tensors)",
               request=InferRequest, response=InferResponse, errors=_INFER_ERRORS),
        _Route("post", base + "/generate", "text generation (Triton's generate extension)",
               request=GenerateRequest, response=_JSON_OBJECT, errors=_INFER_ERRORS),
        _Route("post", base + "/generate_stream", "text generation, one SSE event per reply",
               request=GenerateRequest, response=None, errors=_INFER_ERRORS, media="text/event-stream"),
    ]


_ROUTES: list[_Route] = [
    _Route("get", "/v2", "server metadata", response=ServerMetadata),
    _Route("get", "/v2/health/live", "liveness", response=_JSON_OBJECT),
    _Route("get", "/v2/health/ready", "readiness (every model has a local rung)", response=_JSON_OBJECT,
           errors=(503,)),
    _Route("post", "/v2/repository/index", "the model repository", request=RepositoryIndexRequest,
           response={"type": "array", "items": {"$ref": _REF.format(model="RepositoryModel")}},
           errors=(400, 413), optional_body=True),
    _Route("post", "/v2/repository/models/{model}/load", "load a model", request=RepositoryLoadRequest,
           response=_JSON_OBJECT, errors=(400, 404, 413), optional_body=True),
    _Route("post", "/v2/repository/models/{model}/unload", "unload a model", request=RepositoryLoadRequest,
           response=_JSON_OBJECT, errors=(400, 404, 413), optional_body=True),
    _Route("get", "/v2/jobs/{job_id}", "a durable job's state and result", response=JobBody, errors=(404,)),
    *_model_routes(_MODEL), *_model_routes(_VERSION),
    _Route("get", "/v1/models", "OpenAI: the models", response=ModelList),
    _Route("get", "/v1/models/{model}", "OpenAI: one model (a name or name:version)", response=ModelCard,
           errors=(404,)),
    _Route("post", "/v1/embeddings", "OpenAI: embeddings", request=EmbeddingRequest, response=EmbeddingResponse,
           errors=_INFER_ERRORS),
    _Route("post", "/v1/chat/completions", "OpenAI: chat completions (SSE with stream: true)",
           request=ChatCompletionRequest, response=_JSON_OBJECT, errors=_INFER_ERRORS),
    _Route("post", "/v1/completions", "OpenAI: completions (SSE with stream: true)", request=CompletionRequest,
           response=_JSON_OBJECT, errors=_INFER_ERRORS),
    _Route("get", "/metrics", "Prometheus metrics", media="text/plain"),
    _Route("get", "/ember/status", "models, instances, zygotes and the job queue", response=_JSON_OBJECT),
    _Route("get", "/ui", "the live status page", media="text/html"),
    _Route("get", "/ui/data", "the status page's samples", response=_JSON_OBJECT),
    _Route("get", "/ui/{name}", "the status page's assets", errors=(404,), media="application/octet-stream"),
    _Route("get", "/openapi.json", "this document", response=_JSON_OBJECT),
    _Route("get", "/v2/store/chunks/{digest}", "a weight-store chunk this node holds, for its peers (an admin key "
           "or the cluster token; Range requests)", errors=(400, 401, 403, 404), media="application/octet-stream"),
    _Route("get", "/v2/store/manifests/{name}/{version}", "a weight-store manifest this node holds (a process "
           "image's too), for its peers (an admin key or the cluster token)", errors=(400, 401, 403, 404),
           response=_JSON_OBJECT),
]

_MODELS: tuple[type[BaseModel], ...] = (
    InferRequest, InferResponse, ServerMetadata, ModelMetadata, RepositoryIndexRequest, RepositoryLoadRequest,
    RepositoryModel, JobAcceptedBody, JobBody, ErrorBody, EmbeddingRequest, EmbeddingResponse, ModelList, ModelCard,
    ErrorResponse, ChatCompletionRequest, CompletionRequest, GenerateRequest,
)


def _ref(model: type[BaseModel] | dict[str, Any]) -> dict[str, Any]:
    return model if isinstance(model, dict) else {"$ref": _REF.format(model=model.__name__)}


def _parameters(path: str) -> list[dict[str, Any]]:
    names = [part[1:-1] for part in path.split("/") if part.startswith("{")]
    return [{"name": n, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
            for n in names]


def _operation(route: _Route) -> dict[str, Any]:
    error = ErrorResponse if route.path.startswith("/v1/") else ErrorBody
    ok: dict[str, Any] = {"description": "OK"}
    if route.response is not None or route.media != "application/json":
        ok["content"] = {route.media: {"schema": _ref(route.response) if route.response else {"type": "string"}}}
    responses: dict[str, Any] = {"200": ok}
    if route.request is not None and route.method == "post" and route.path != "/v2/repository/index":
        responses["202"] = {"description": "queued as a durable job (Prefer: respond-async, or no room)",
                            "content": {"application/json": {"schema": _ref(JobAcceptedBody)}}}
    for status in route.errors:
        responses[str(status)] = {"description": "error", "content": {"application/json": {"schema": _ref(error)}}}
    op: dict[str, Any] = {"summary": route.summary, "operationId": f"{route.method} {route.path}",
                          "parameters": _parameters(route.path), "responses": responses}
    if route.request is not None:
        op["requestBody"] = {"required": not route.optional_body,
                             "content": {"application/json": {"schema": _ref(route.request)}}}
    return op


@cache
def openapi_document() -> dict[str, Any]:
    """The whole document (built once; it depends only on the code)."""
    _, defs = models_json_schema([(m, "validation") for m in _MODELS], ref_template=_REF)
    paths: dict[str, dict[str, Any]] = {}
    for route in _ROUTES:
        paths.setdefault(route.path, {})[route.method] = _operation(route)
    return {"openapi": "3.1.0", "info": {"title": "ember", "version": ember.__version__,
                                          "description": "KServe V2 and OpenAI-compatible inference"},
            "paths": paths, "components": {"schemas": defs.get("$defs", {})}}


def route_table() -> list[tuple[str, str]]:
    """(method, path) of every documented route (tests check it against the app's routes)."""
    return [(r.method.upper(), r.path) for r in _ROUTES]
