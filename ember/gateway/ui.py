"""The live status page: `GET /ui` (plain HTML, JS and CSS shipped in ember/gateway/static) and `GET /ui/data`.

The timeline holds the last ten minutes whether or not anyone looks: `ember serve` samples it once a second from
its start (`Sampler.start`), so a page opened now shows what happened before it was. A sample reads the metrics
registry the gateway keeps anyway (requests, latencies, rungs, cold starts, jobs) and the service's status
(models, instances by state, memory). The status reads every instance's PSS (a 1 GiB model's smaps: ~12 ms here),
so while nobody looks it is read every STATUS_EVERY_S (as the tick reads memory, ember.serving.actuator) and the
samples between take the last one; while a page polls, every second. It is read on a worker thread, never on the
event loop (but for the baseline `start` takes). The request path does no work for the page.
An app that nobody started sampling (one built by `create_app` alone) samples on each /ui/data poll and from a
task the first poll starts, which ends once no poll has come for LINGER_S.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.clock import SystemClock
from ember.core.clock import Clock
from ember.gateway.context import Gateway, gateway_of
from ember.gateway.readings import Reading, read
from ember.gateway.timeline import OTHER, Timeline, model_key
from ember.serving.results import ModelStatus

# A background tab's timers are throttled to about one a minute; sampling goes on that long without polls.
LINGER_S = 75.0
STATUS_EVERY_S = 5.0   # how often the status is read for the timeline while nobody looks
ASSETS = {"ui.js": "text/javascript", "ui.css": "text/css"}


@dataclass
class Sampler:
    timeline: Timeline
    last_poll: float = float("-inf")
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    status: list[ModelStatus] | None = field(default=None, repr=False)   # the last read, and when
    status_at: float = float("-inf")
    unlisted: frozenset[str] = frozenset()   # models with metrics that the last status did not list

    def sample(self, gateway: Gateway, status: list[ModelStatus] | None = None) -> None:
        """Sample if due, with `status`, else the last status read, else one read here (on the caller's thread)."""
        if not self.timeline.due():
            return
        reading = read(gateway.metrics.registry)
        if status is None and self._stale(reading):
            status = gateway.service.status()
        self._add(status, reading)

    async def sample_off_loop(self, gateway: Gateway) -> None:
        """Sample if due; a status read (every instance's PSS) runs on a worker thread, not on the event loop."""
        if not self.timeline.due():
            return
        reading = read(gateway.metrics.registry)
        status = await asyncio.to_thread(gateway.service.status) if self._stale(reading) else None
        if self.timeline.due():   # a poll may have sampled while the status was read
            self._add(status, reading)
        elif status is not None:
            self.status, self.status_at = status, self.timeline.clock.now()

    def _stale(self, reading: Reading) -> bool:
        """Whether the last status read is too old for a sample, or misses a model deployed since (its samples)."""
        now = self.timeline.clock.now()
        return self.status is None or now - self.status_at >= self._status_every(now) or \
            not self._unlisted(self.status, reading) <= self.unlisted

    def _add(self, status: list[ModelStatus] | None, reading: Reading) -> None:
        if status is not None:
            self.status, self.status_at = status, self.timeline.clock.now()
        assert self.status is not None   # read whenever none was
        self.unlisted = self._unlisted(self.status, reading)
        self.timeline.add(self.status, reading)

    def _status_every(self, now: float) -> float:
        return self.timeline.interval_s * 0.9 if now - self.last_poll < LINGER_S else STATUS_EVERY_S

    @staticmethod
    def _unlisted(status: list[ModelStatus], reading: Reading) -> frozenset[str]:
        """Models the metrics name that `status` does not list (deployed since it was read, or gone since)."""
        listed = {model_key(m.name, m.version) for m in status}
        return frozenset(model_key(*k) for k in reading.models() if k != (OTHER, OTHER)) - listed

    def poll(self, gateway: Gateway, status: list[ModelStatus]) -> None:
        """A viewer asked: sample if due, and keep (or start) sampling while viewers keep asking."""
        clock = self.timeline.clock
        self.last_poll = clock.now()
        self.sample(gateway, status)
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._run(gateway, lambda: clock.now() - self.last_poll < LINGER_S))

    def start(self, gateway: Gateway) -> asyncio.Task[None]:
        """Sample from now on, whether or not anyone looks (until the task is cancelled): the server's sampler."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
        with contextlib.suppress(Exception):
            self.sample(gateway)   # the baseline: the first request counts in the next sample
        self.task = asyncio.ensure_future(self._run(gateway, lambda: True))
        return self.task

    async def _run(self, gateway: Gateway, going: Callable[[], bool]) -> None:
        while going():
            await asyncio.sleep(self.timeline.interval_s)
            with contextlib.suppress(Exception):  # a status that fails once must not end the page's data
                await self.sample_off_loop(gateway)


def sampler_of(request: Request, clock: Clock | None = None) -> Sampler:
    """The app's one sampler (`app_sampler`)."""
    return app_sampler(request.app, clock)


def app_sampler(app: Starlette, clock: Clock | None = None) -> Sampler:
    """The app's one sampler, made on first use."""
    state = app.state
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
    status = await asyncio.to_thread(gateway.service.status)   # every instance's PSS: not on the event loop
    sampler.poll(gateway, status)
    return JSONResponse(sampler.timeline.snapshot(status), headers={"cache-control": "no-store"})


def _asset(name: str) -> bytes:
    return (resources.files("ember.gateway") / "static" / name).read_bytes()
