"""The app factory: the routes table, and the one place errors become responses and metrics.

Every endpoint is wrapped by `_guard`: an EmberError becomes its status code (table in
ember.gateway.errors) and the API's error shape; any other exception is logged with its
traceback and answered 500 `internal error`. The wrapper also records the request in the
metrics, labelled by model (only once the model is known to exist), API and status code.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.errors import EmberError
from ember.gateway import chat_api, jobs_api, openai_api, ops, ui, v2, v2_generate
from ember.gateway.access_log import AccessLog
from ember.gateway.context import Gateway, gateway_of
from ember.gateway.errors import internal_error, openai_error, v2_error
from ember.gateway.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_INFLIGHT_BYTES,
    BodyBudget,
)
from ember.gateway.openapi import openapi_document
from ember.gateway.service import Service
from ember.metrics import Metrics

Handler = Callable[[Request], Awaitable[Response]]
Render = Callable[[EmberError], Response]


def _guard(api: str, handler: Handler, render: Render = v2_error) -> Handler:
    async def endpoint(request: Request) -> Response:
        start = time.perf_counter()
        try:
            response = await handler(request)
        except EmberError as err:
            response = render(err)
        except Exception as exc:
            response = render(internal_error(exc, f"{request.method} {request.url.path}"))
        finally:
            gateway_of(request).budget.release(request)
        model = getattr(request.state, "model", "")
        gateway, latency = gateway_of(request), time.perf_counter() - start
        gateway.metrics.observe_request(model, api, response.status_code, latency)
        if gateway.access_log is not None:
            gateway.access_log.record(request, response, model, api, latency)
        return response

    return endpoint


def _routes() -> list[Route]:
    model = "/v2/models/{model}"
    version = "/v2/models/{model}/versions/{version}"
    routes = [
        Route("/v2", _guard("v2", v2.server_metadata)),
        Route("/v2/health/live", _guard("health", v2.live)),
        Route("/v2/health/ready", _guard("health", v2.ready)),
        Route("/v2/repository/index", _guard("repository", v2.repository_index), methods=["POST"]),
        Route("/v2/repository/models/{model}/load", _guard("repository", v2.load), methods=["POST"]),
        Route("/v2/repository/models/{model}/unload", _guard("repository", v2.unload), methods=["POST"]),
        Route("/v2/jobs/{job_id}", _guard("jobs", jobs_api.get_job)),
        Route("/v1/models", _guard("openai", openai_api.list_models, openai_error)),
        Route("/v1/embeddings", _guard("openai", openai_api.embeddings, openai_error), methods=["POST"]),
        Route("/v1/chat/completions", _guard("openai", chat_api.chat_completions, openai_error), methods=["POST"]),
        Route("/v1/completions", _guard("openai", chat_api.completions, openai_error), methods=["POST"]),
        Route("/metrics", _guard("ops", ops.metrics)),
        Route("/ember/status", _guard("ops", ops.status)),
        Route("/ui", _guard("ui", ui.page)), Route("/ui/data", _guard("ui", ui.data)),
        Route("/ui/{name}", _guard("ui", ui.asset)),
        Route("/openapi.json", _guard("ops", _openapi)),
    ]
    for base in (model, version):
        routes += [
            Route(base, _guard("v2", v2.model_metadata)),
            Route(base + "/ready", _guard("v2", v2.model_ready)),
            Route(base + "/infer", _guard("v2", v2.infer), methods=["POST"]),
            Route(base + "/generate", _guard("v2", v2_generate.generate), methods=["POST"]),
            Route(base + "/generate_stream", _guard("v2", v2_generate.generate_stream), methods=["POST"]),
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
               access_log: AccessLog | None = None) -> Starlette:
    """The ASGI app of the gateway; serve it with uvicorn."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes: must be at least 1, got {max_body_bytes}")
    if max_inflight_bytes < max_body_bytes:
        raise ValueError(f"max_inflight_bytes ({max_inflight_bytes}) must hold at least one body of max_body_bytes "
                         f"({max_body_bytes})")
    if body_timeout_s <= 0:
        raise ValueError(f"body_timeout_s: must be positive, got {body_timeout_s}")
    app = Starlette(routes=_routes(), exception_handlers={HTTPException: _http_error})
    app.state.gateway = Gateway(service, metrics, max_body_bytes, started_at=int(time.time()),
                                budget=BodyBudget(max_inflight_bytes), body_timeout_s=body_timeout_s,
                                access_log=access_log)
    return app
