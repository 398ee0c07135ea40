"""The live status page: `GET /ui` (plain HTML, JS and CSS shipped in ember/gateway/static) and `GET /ui/data`.

The timeline is sampled only while someone looks: on each /ui/data poll, and by a background task that the
first poll starts and that ends once no poll has come for LINGER_S. Between looks the server does no work
for the page (and the request path never does any).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from importlib import resources

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.clock import SystemClock
from ember.core.clock import Clock
from ember.gateway.context import Gateway, gateway_of
from ember.gateway.readings import read
from ember.gateway.timeline import Timeline
from ember.serving.results import ModelStatus

# A background tab's timers are throttled to about one a minute; sampling goes on that long without polls.
LINGER_S = 75.0
ASSETS = {"ui.js": "text/javascript", "ui.css": "text/css"}


@dataclass
class Sampler:
    timeline: Timeline
    last_poll: float = float("-inf")
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def sample(self, gateway: Gateway, status: list[ModelStatus] | None = None) -> None:
        if self.timeline.due():
            self.timeline.add(gateway.service.status() if status is None else status, read(gateway.metrics.registry))

    def poll(self, gateway: Gateway, status: list[ModelStatus]) -> None:
        """A viewer asked: sample if due, and keep (or start) sampling while viewers keep asking."""
        self.last_poll = self.timeline.clock.now()
        self.sample(gateway, status)
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._run(gateway))

    async def _run(self, gateway: Gateway) -> None:
        clock = self.timeline.clock
        while clock.now() - self.last_poll < LINGER_S:
            await asyncio.sleep(self.timeline.interval_s)
            with contextlib.suppress(Exception):  # a status that fails once must not end the page's data
                self.sample(gateway)


def sampler_of(request: Request, clock: Clock | None = None) -> Sampler:
    """The app's one sampler, made on first use (most servers never have the page opened)."""
    state = request.app.state
    if getattr(state, "ui_sampler", None) is None:
        state.ui_sampler = Sampler(Timeline(clock or SystemClock()))
    sampler: Sampler = state.ui_sampler
    return sampler


async def page(request: Request) -> Response:
    return Response(_asset("ui.html"), media_type="text/html; charset=utf-8")


async def asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in ASSETS:
        return JSONResponse({"error": f"/ui/{name}: no such file (the page's files: {', '.join(sorted(ASSETS))})"},
                            status_code=404)
    return Response(_asset(name), media_type=ASSETS[name] + "; charset=utf-8", headers={"cache-control": "no-cache"})


async def data(request: Request) -> Response:
    gateway, sampler = gateway_of(request), sampler_of(request)
    status = gateway.service.status()
    sampler.poll(gateway, status)
    return JSONResponse(sampler.timeline.snapshot(status), headers={"cache-control": "no-store"})


def _asset(name: str) -> bytes:
    return (resources.files("ember.gateway") / "static" / name).read_bytes()
