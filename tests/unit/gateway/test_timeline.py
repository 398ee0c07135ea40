"""The status page's timeline: percentiles from differenced histogram buckets, the ring's bounds, the routes."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from starlette.testclient import TestClient

from ember.core.states import Rung
from ember.gateway.app import create_app
from ember.gateway.context import Gateway
from ember.gateway.limits import BodyBudget
from ember.gateway.readings import Sample, quantile, read, reading_of
from ember.gateway.timeline import Timeline
from ember.gateway.ui import LINGER_S, STATUS_EVERY_S, Sampler
from ember.jobs.store import JobStore
from ember.metrics import Metrics
from ember.serving.results import ModelStatus
from ember.testing.clock import FakeClock
from ember.testing.service import FakeService

IRIS = [ModelStatus("iris", "1", "ready", None, [{"id": "i-0", "state": "idle", "rung": "template", "slice": "cpu-0",
                                                   "pss_bytes": 3 * 2**20}])]
X = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}


def test_quantile_interpolates_within_the_bucket_like_histogram_quantile() -> None:
    buckets = {0.001: 0.0, 0.01: 50.0, 0.1: 100.0, math.inf: 100.0}
    assert quantile(0.5, buckets) == pytest.approx(0.01)
    assert quantile(0.95, buckets) == pytest.approx(0.01 + 0.09 * 45 / 50)
    assert quantile(0.25, buckets) == pytest.approx(0.001 + 0.009 * 25 / 50)


def test_quantile_without_observations_is_none_and_the_inf_bucket_reads_as_the_top_bound() -> None:
    assert quantile(0.5, {}) is None
    assert quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
    assert quantile(0.99, {0.1: 1.0, 1.0: 1.0, math.inf: 10.0}) == 1.0


def _requests(model: str, version: str | None, le_counts: dict[float, float]) -> list[Sample]:
    labels = {"model": model, "api": "v2"} | ({"version": version} if version is not None else {})
    return [Sample("ember_request_duration_seconds_bucket", labels | {"le": str(le)}, n) for le, n in le_counts.items()]


def test_a_sample_holds_only_its_interval_and_tolerates_a_missing_version() -> None:
    clock = FakeClock()
    timeline = Timeline(clock)
    # Ten slow requests before the baseline, then 100 fast ones: the interval's p99 knows nothing of the slow.
    before = _requests("iris", "1", {0.01: 0, 10.0: 10, math.inf: 10})
    timeline.add(IRIS, reading_of(before))
    clock.advance(1)
    now = (_requests("iris", "1", {0.01: 60, 10.0: 70, math.inf: 70})   # 60 fast, labelled with the version
           + _requests("iris", None, {0.01: 40, 10.0: 40, math.inf: 40}))  # 40 fast, from a metric without one
    sample = timeline.add(IRIS, reading_of(now))
    iris = sample.models["iris:1"]
    assert iris["requests"] == 100
    assert iris["p50"] == pytest.approx(0.005) and iris["p99"] == pytest.approx(0.0099)
    assert iris["instances"] == {"idle": 1} and sample.node_pss_bytes == 3 * 2**20


def test_rungs_cold_starts_and_gauges_read_from_the_real_registry() -> None:
    metrics, clock = Metrics(), FakeClock()
    timeline = Timeline(clock)
    timeline.add(IRIS, read(metrics.registry))
    metrics.observe_request("iris:1", "v2", 200, 0.002)
    metrics.observe_ladder("iris:1", Rung.TEMPLATE, 0.01, 0.02)
    metrics.cold_start("iris:1", Rung.TEMPLATE, {"spawn": 0.01})
    metrics.set_jobs("iris:1", 4, 2.0)
    clock.advance(1)
    sample = timeline.add(IRIS, read(metrics.registry))
    iris = sample.models["iris:1"]
    assert iris["requests"] == 1 and 0.001 < iris["p50"] <= 0.002
    assert iris["cold_starts"] == {"template": 1}
    assert iris["rungs"] == {"template": 1} and iris["jobs_queued"] == 4
    assert "" not in sample.models   # every series carries the model now


def test_the_ring_keeps_the_window_and_at_most_window_over_interval_samples() -> None:
    clock = FakeClock()
    timeline = Timeline(clock, window_s=10, interval_s=1)
    reading = reading_of([])
    for _ in range(25):
        assert timeline.due()
        timeline.add(IRIS, reading)
        assert not timeline.due()
        clock.advance(1)
    assert len(timeline.samples) == 10 and timeline.samples[0].t == clock.now() - 10
    clock.advance(100)   # nobody looked for a while: what is older than the window goes
    timeline.add(IRIS, reading)
    assert [s.t for s in timeline.samples] == [clock.now()]


def test_routes_serve_the_page_its_assets_and_the_timeline(client: TestClient) -> None:
    clock = FakeClock()
    client.app.state.ui_sampler = Sampler(Timeline(clock))  # type: ignore[attr-defined]
    page = client.get("/ui")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"] and "<canvas" in page.text
    assert client.get("/ui/ui.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/ui/ui.css").status_code == 200 and client.get("/ui/nope.js").status_code == 404
    first = client.get("/ui/data").json()
    assert {m["name"] for m in first["models"]} >= {"affine", "embedder"} and len(first["samples"]) == 1
    client.post("/v2/models/affine/infer", json=X)
    clock.advance(1)
    data = client.get("/ui/data").json()
    assert len(data["samples"]) == 2 and data["samples"][-1]["models"]["affine:1"]["requests"] == 1
    assert "" not in data["samples"][-1]["models"]   # the page's own polls are not requests to a model


def test_the_background_sampler_stops_once_nobody_polls(service: FakeService, metrics: Metrics) -> None:
    clock = FakeClock()
    sampler = Sampler(Timeline(clock, interval_s=0.01))
    gateway = Gateway(service, metrics, 1024, started_at=0, budget=BodyBudget(1024), body_timeout_s=1.0)

    async def look_then_leave() -> int:
        sampler.poll(gateway, service.status())
        await asyncio.sleep(0.05)
        assert sampler.task is not None and not sampler.task.done()
        clock.advance(LINGER_S)
        await asyncio.wait_for(sampler.task, timeout=5)
        return len(sampler.timeline.samples)

    assert asyncio.run(look_then_leave()) >= 2   # the poll's sample, and the task's while the viewer looked


def test_a_started_sampler_keeps_the_window_before_anyone_looks(jobs: JobStore, metrics: Metrics) -> None:
    """`ember serve` starts it: a page opened later gets what happened before it (the request, every second); the
    status (every instance's PSS) is read every STATUS_EVERY_S meanwhile, every second once a page polls."""
    clock, service = FakeClock(), CountingService(jobs=jobs)
    sampler = Sampler(Timeline(clock, interval_s=0.01))
    gateway = Gateway(service, metrics, 1024, started_at=0, budget=BodyBudget(1024), body_timeout_s=1.0)

    async def nobody_looks() -> list[int]:
        task = sampler.start(gateway)
        seen = []
        for step in range(2 * int(STATUS_EVERY_S)):
            await asyncio.sleep(0.05)
            if step == 2:
                metrics.observe_request("affine:1", "v2", 200, 0.002)
            clock.advance(1)
            seen.append(len(sampler.timeline.samples))
        assert service.reads <= 3   # the start's, then one per STATUS_EVERY_S
        clock.advance(LINGER_S)   # no poll ever came: it samples on
        await asyncio.sleep(0.05)
        assert not task.done()
        reads = service.reads
        for _ in range(3):   # a page polls: the status of every sample is fresh
            sampler.poll(gateway, service.status())
            clock.advance(1)
            await asyncio.sleep(0.05)
        assert service.reads >= reads + 6
        task.cancel()
        return seen

    seen = asyncio.run(nobody_looks())
    assert seen == sorted(seen) and seen[-1] >= 2 * STATUS_EVERY_S
    requests = sum(s.models["affine:1"]["requests"] for s in sampler.timeline.samples)
    assert requests == 1


def test_a_model_deployed_between_status_reads_has_its_first_requests_sampled(jobs: JobStore,
                                                                             metrics: Metrics) -> None:
    """The status is read every STATUS_EVERY_S while nobody looks, and at once when the metrics name a model it did
    not list: a model deployed after the server started has its first requests in the timeline."""
    clock, service = FakeClock(), CountingService(jobs=jobs, listed=False)   # nothing deployed yet
    sampler = Sampler(Timeline(clock, interval_s=0.01))
    gateway = Gateway(service, metrics, 1024, started_at=0, budget=BodyBudget(1024), body_timeout_s=1.0)

    async def deploy_then_call() -> None:
        task = sampler.start(gateway)
        service.listed = True
        metrics.observe_request("affine:1", "v2", 200, 0.002)
        clock.advance(1)
        await asyncio.sleep(0.05)
        clock.advance(1)
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(deploy_then_call())
    assert sum(s.models.get("affine:1", {}).get("requests", 0) for s in sampler.timeline.samples) == 1
    assert service.reads == 2   # the start's, and the one the new model's metrics asked for


def test_the_background_sampler_reads_the_status_off_the_event_loop(jobs: JobStore, metrics: Metrics) -> None:
    """A status read takes every instance's PSS (~12 ms a GiB): the sampler's, every STATUS_EVERY_S for as long as
    the server runs, and a poll's must not hold the event loop (the requests it serves) meanwhile."""
    clock, service = FakeClock(), CountingService(jobs=jobs)
    sampler = Sampler(Timeline(clock, interval_s=0.01))
    gateway = Gateway(service, metrics, 1024, started_at=0, budget=BodyBudget(1024), body_timeout_s=1.0)

    async def sample_a_while() -> None:
        task = sampler.start(gateway)
        while service.reads < 3:
            clock.advance(STATUS_EVERY_S)
            await asyncio.sleep(0.02)
        task.cancel()

    asyncio.run(sample_a_while())
    assert service.on_loop[0]   # the start's baseline, before anything is served
    assert len(service.on_loop) >= 3 and not any(service.on_loop[1:])
    assert len(sampler.timeline.samples) >= 3


def test_a_poll_reads_the_status_off_the_event_loop(jobs: JobStore, metrics: Metrics) -> None:
    service = CountingService(jobs=jobs)
    with TestClient(create_app(service, metrics, max_body_bytes=1024)) as client:
        assert client.get("/ui/data").status_code == 200
    assert service.on_loop == [False]


class CountingService(FakeService):
    """Counts its status reads (each reads every instance's PSS on a real node); lists no model until `listed`."""

    reads = 0
    listed = True

    def __init__(self, *, listed: bool = True, **fields: Any) -> None:
        super().__init__(**fields)
        self.listed = listed
        self.on_loop: list[bool] = []   # whether each read ran on an event loop's thread

    def status(self) -> list[ModelStatus]:
        self.reads += 1
        self.on_loop.append(_on_a_loop())
        return super().status() if self.listed else []


def _on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
