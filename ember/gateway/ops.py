"""Operator endpoints: Prometheus metrics and the JSON status behind `ember status`."""

from __future__ import annotations

import dataclasses

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.gateway.context import gateway_of
from ember.metrics import CONTENT_TYPE


async def metrics(request: Request) -> Response:
    return Response(gateway_of(request).metrics.text(), media_type=CONTENT_TYPE)


async def status(request: Request) -> Response:
    """{"models": [ModelStatus as a dict, ...], "node": {"zygotes": [...], "jobs": [...]}}."""
    service = gateway_of(request).service
    models = [dataclasses.asdict(m) for m in service.status()]
    return JSONResponse({"models": models, "node": await service.node_status()})
