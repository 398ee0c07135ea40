"""What every endpoint reaches through the request: the service, metrics and limits."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio.to_thread
from starlette.requests import Request

from ember.gateway.service import Service
from ember.metrics import Metrics

T = TypeVar("T")

# Bodies above this are parsed and encoded on a worker thread, so a big request does not
# hold up the event loop (and with it every other request).
OFF_LOOP_BYTES = 256 * 1024


@dataclass(frozen=True)
class Gateway:
    service: Service
    metrics: Metrics
    max_body_bytes: int
    started_at: int  # unix seconds; OpenAI's `created` for every model


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def label_model(request: Request, name: str) -> None:
    """Name the model in this request's metrics (only models that exist, so labels stay bounded)."""
    request.state.model = name


def prefers_async(request: Request) -> bool:
    """RFC 7240 `Prefer: respond-async` (among other comma-separated preferences)."""
    prefer = request.headers.get("prefer", "")
    return any(p.split(";")[0].strip().lower() == "respond-async" for p in prefer.split(","))


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    if size < OFF_LOOP_BYTES:
        return fn(*args)
    return await anyio.to_thread.run_sync(functools.partial(fn, *args))
