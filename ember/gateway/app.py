"""The app factory: the routes table, and the one place errors become responses and metrics.

Every endpoint is wrapped by `_guard`: it first admits the request (`ember.gateway.auth`: cross-site
refusal, Content-Type, API key, role, rate limit; each route names its access level and the media types
its POST body may have), then an EmberError becomes its status code (table in ember.gateway.errors) and
the API's error shape; any other exception is logged with its traceback and answered 500 `internal
error`. The wrapper also records the request in the metrics, labelled by model (only once the model is
known to exist and visible to the caller), API and status code, and traces it: one root span per request
(`docs/tracing.md`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ember.core.access import Access
from ember.errors import EmberError
from ember.gateway import chat_api, jobs_api, openai_api, ops, store_api, ui, v2, v2_generate
from ember.gateway.access_log import AccessLog
from ember.gateway.auth import JSON, JSON_OR_BINARY, Auth, TenantView
from ember.gateway.caller import Caller, set_caller
from ember.gateway.context import Gateway, NoRequestTracer, RequestTracer, gateway_of
from ember.gateway.errors import internal_error, openai_error, v2_error
from ember.gateway.limits import (
    DEFAULT_BODY_DEADLINE_S,
    DEFAULT_BODY_MIN_RATE,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_INFLIGHT_BYTES,
    BodyBudget,
)
from ember.gateway.openapi import openapi_document
from ember.gateway.service import Service
from ember.gateway.store_api import ChunkFiles
from ember.metrics import Metrics, split_key
from ember.serving.ports import Span

Handler = Callable[[Request], Awaitable[Response]]
Render = Callable[[EmberError], Response]
PUBLIC, USER, ADMIN, PEER = Access.PUBLIC, Access.USER, Access.ADMIN, Access.PEER


def _guard(path: str, api: str, handler: Handler, render: Render = v2_error, access: Access = USER,
           accepts: tuple[str, ...] = JSON) -> Handler:
    async def endpoint(request: Request) -> Response:
        start, gateway = time.perf_counter(), gateway_of(request)
        with gateway.tracer.request(f"{request.method} {path}", request.headers) as span:
            span.set("http.request.method", request.method)
            span.set("http.route", path)
            try:
                _admit(request, access, accepts)
                response = await handler(request)
            except EmberError as err:
                response = render(err)
            except Exception as exc:
                response = render(internal_error(exc, f"{request.method} {request.url.path}"))
            finally:
                gateway.budget.release(request)
        model = getattr(request.state, "model", "")
        latency = time.perf_counter() - start
        gateway.metrics.observe_request(model, api, response.status_code, latency)
        if gateway.access_log is not None:
            gateway.access_log.record(request, response, model, api, latency)
        _trace(span, response, model, api)
        return response

    return endpoint


def _admit(request: Request, access: Access, accepts: tuple[str, ...]) -> None:
    gateway = gateway_of(request)
    principal = gateway.auth.admit(request, access, accepts)
    set_caller(Caller.of(request.headers, principal.tenant if principal is not None else None,
                         gateway.tracer.context_headers()))
    if principal is not None:
        request.state.gateway = dataclasses.replace(gateway, service=TenantView(gateway.service, principal))


def _trace(span: Span, response: Response, model: str, api: str) -> None:
    """Name what the request was in its root span, and end it once the response is sent."""
    name, version = split_key(model)
    span.set("http.response.status_code", response.status_code)
    span.set("ember.api", api)
    for key, value in (("ember.model", name), ("ember.version", version),
                       ("ember.rung", response.headers.get("ember-rung", ""))):
        if value:
            span.set(key, value)
    if response.status_code >= 500:
        span.fail(f"status {response.status_code}")
    if isinstance(response, StreamingResponse):
        response.body_iterator = _ending(span, response.body_iterator)   # a stream's request lasts to its end
    else:
        span.end()


async def _ending(span: Span, body: AsyncIterable[str | bytes | memoryview]) -> AsyncIterator[str | bytes | memoryview]:
    try:
        async for chunk in body:
            yield chunk
    finally:
        span.end()
        if isinstance(body, AsyncGenerator):
            await body.aclose()   # now, as if unwrapped (a client gone: its request is withdrawn)


def _route(path: str, api: str, handler: Handler, render: Render = v2_error, *, post: bool = False,
           access: Access = USER, accepts: tuple[str, ...] = JSON) -> Route:
    return Route(path, _guard(path, api, handler, render, access, accepts), methods=["POST"] if post else None)


guarded_route = _route   # for routes added beside the app's own (ember/gateway/cluster_api.py)
guard = _guard   # for the gRPC binding (ember/gateway/grpc_api.py): an RPC admitted, measured and answered as a route


def _routes() -> list[Route]:
    model = "/v2/models/{model}"
    version = "/v2/models/{model}/versions/{version}"
    routes = [
        _route("/v2", "v2", v2.server_metadata, access=PUBLIC),
        _route("/v2/health/live", "health", v2.live, access=PUBLIC),
        _route("/v2/health/ready", "health", v2.ready, access=PUBLIC),
        _route("/v2/repository/index", "repository", v2.repository_index, post=True),
        _route("/v2/repository/models/{model}/load", "repository", v2.load, post=True, access=ADMIN),
        _route("/v2/repository/models/{model}/unload", "repository", v2.unload, post=True, access=ADMIN),
        _route("/v2/jobs/{job_id}", "jobs", jobs_api.get_job),
        _route("/v1/models", "openai", openai_api.list_models, openai_error),
        _route("/v1/models/{model}", "openai", openai_api.get_model, openai_error),
        _route("/v1/embeddings", "openai", openai_api.embeddings, openai_error, post=True),
        _route("/v1/chat/completions", "openai", chat_api.chat_completions, openai_error, post=True),
        _route("/v1/completions", "openai", chat_api.completions, openai_error, post=True),
        _route("/metrics", "ops", ops.metrics, access=ADMIN),
        _route("/ember/status", "ops", ops.status, access=ADMIN),
        _route("/ui", "ui", ui.page, access=PUBLIC),
        _route("/ui/data", "ui", ui.data, access=ADMIN),
        _route("/ui/{name}", "ui", ui.asset, access=PUBLIC),
        _route("/openapi.json", "ops", _openapi, access=PUBLIC),
        _route("/v2/store/chunks/{digest}", "store", store_api.chunk, access=PEER),
        _route("/v2/store/manifests/{name}/{version}", "store", store_api.manifest, access=PEER),
    ]
    for base in (model, version):
        routes += [
            _route(base, "v2", v2.model_metadata),
            _route(base + "/ready", "v2", v2.model_ready),
            _route(base + "/config", "v2", v2.model_config),
            _route(base + "/infer", "v2", v2.infer, post=True, accepts=JSON_OR_BINARY),
            _route(base + "/generate", "v2", v2_generate.generate, post=True),
            _route(base + "/generate_stream", "v2", v2_generate.generate_stream, post=True),
        ]
    return routes


async def _openapi(request: Request) -> Response:
    return JSONResponse(openapi_document())


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no route) / 405 (wrong method), in the API's error shape."""
    assert isinstance(exc, HTTPException)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    if request.url.path.startswith("/v1/"):
        body: dict[str, object] = {"error": {"message": message, "type": "invalid_request_error",
                                             "param": None, "code": None}}
    else:
        body = {"error": message}
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def create_app(service: Service, metrics: Metrics, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
               access_log: AccessLog | None = None, tracer: RequestTracer | None = None,
               auth: Auth | None = None, chunks: ChunkFiles | None = None,
               body_min_rate: float = DEFAULT_BODY_MIN_RATE, body_deadline_s: float = DEFAULT_BODY_DEADLINE_S,
               ) -> Starlette:
    """The ASGI app of the gateway; serve it with uvicorn. `auth` None: no API keys, no rate limits
    (cross-site requests are refused all the same). `chunks`: the weight-store chunks served to peers."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes: must be at least 1, got {max_body_bytes}")
    if max_inflight_bytes < max_body_bytes:
        raise ValueError(f"max_inflight_bytes ({max_inflight_bytes}) must hold at least one body of max_body_bytes "
                         f"({max_body_bytes})")
    if body_timeout_s <= 0:
        raise ValueError(f"body_timeout_s: must be positive, got {body_timeout_s}")
    if body_min_rate < 0 or body_deadline_s <= 0:
        raise ValueError(f"body_min_rate ({body_min_rate}) must be >= 0 and body_deadline_s ({body_deadline_s}) "
                         "positive")
    app = Starlette(routes=_routes(), exception_handlers={HTTPException: _http_error})
    app.state.gateway = Gateway(service, metrics, max_body_bytes, started_at=int(time.time()),
                                budget=BodyBudget(max_inflight_bytes), body_timeout_s=body_timeout_s,
                                body_min_rate=body_min_rate, body_deadline_s=body_deadline_s,
                                access_log=access_log, tracer=tracer or NoRequestTracer(), auth=auth or Auth(),
                                chunks=chunks)
    return app
