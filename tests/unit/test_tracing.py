"""OpenTelemetry traces: the gateway over a controller on a FakeNode, spans caught by the SDK's in-memory exporter.

Each test owns its TracerProvider (never the global one), so no span leaks from one test into another.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from ember.config import ServeConfig
from ember.errors import InvalidInput
from ember.gateway.app import create_app
from ember.jobs.store import JobStore
from ember.metrics import Metrics
from ember.testing.controller import World, settle, write
from ember.testing.service import FakeService
from ember.tracing import OtelTracer, exporting_provider

INFER = "/v2/models/m/infer"
BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 2], "data": [1, 1, 1, 1, 1, 1]}]}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer(exporter: InMemorySpanExporter) -> Iterator[OtelTracer]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = OtelTracer(provider)
    yield tracer
    tracer.close()


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    write(tmp_path, "m", max_scale=1)
    return tmp_path


class Traced:
    """A World behind the gateway, both tracing to one tracer."""

    def __init__(self, tmp: Path, tracer: OtelTracer, exporter: InMemorySpanExporter, **settings: object) -> None:
        self.world = World(tmp, tracer=tracer, **settings)
        self.exporter = exporter
        app = create_app(self.world.ctl, self.world.metrics, tracer=tracer)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ember")

    async def post(self, path: str = INFER, **headers: str) -> httpx.Response:
        response = await self.client.post(path, json=BODY, headers=headers)
        assert response.status_code in (200, 202), response.text
        return response

    def take(self) -> dict[str, ReadableSpan]:
        """The spans exported since the last take, by name (each name once)."""
        spans = self.exporter.get_finished_spans()
        self.exporter.clear()
        by_name = {s.name: s for s in spans}
        assert len(by_name) == len(spans), [s.name for s in spans]
        return by_name


async def _traced(tmp: Path, tracer: OtelTracer, exporter: InMemorySpanExporter, **settings: object) -> Traced:
    t = Traced(tmp, tracer, exporter, **settings)
    await t.world.ctl.deploy_all()
    return t


def _children(spans: dict[str, ReadableSpan], root: ReadableSpan) -> set[str]:
    return {name for name, s in spans.items() if s.parent is not None and s.parent.span_id == root.context.span_id}


pytestmark = pytest.mark.anyio


async def test_a_cold_request_forks_with_its_start_phases(tmp: Path, tracer: OtelTracer,
                                                          exporter: InMemorySpanExporter) -> None:
    t = await _traced(tmp, tracer, exporter)
    await t.post()
    spans = t.take()
    root = spans["POST /v2/models/{model}/infer"]
    assert root.kind is SpanKind.SERVER and root.parent is None
    assert root.attributes is not None
    assert dict(root.attributes) == {"http.request.method": "POST", "http.route": "/v2/models/{model}/infer",
                                     "http.response.status_code": 200, "ember.api": "v2", "ember.model": "m",
                                     "ember.version": "1", "ember.rung": "template"}
    assert _children(spans, root) == {"decode", "fork", "inference", "encode"}
    fork = spans["fork"]
    assert fork.attributes is not None and fork.attributes["ember.rung"] == "template"
    assert _children(spans, fork) == {"spawn"} and "ember.phase.spawn_s" in fork.attributes
    assert {s.context.trace_id for s in spans.values()} == {root.context.trace_id}


async def test_a_remote_models_start_lays_out_spawn_then_fetch(tmp: Path, tracer: OtelTracer,
                                                               exporter: InMemorySpanExporter) -> None:
    write(tmp, "m", template=False)
    t = Traced(tmp, tracer, exporter)
    t.world.node.remote.add("m:1")
    t.world.node.fetch_delay = 0.001   # a phase the node reports only when it took time
    await t.world.ctl.deploy_all()
    await t.post()
    spans = t.take()
    fork = spans["fork"]
    assert fork.attributes is not None and fork.attributes["ember.rung"] == "fetch"
    assert _children(spans, fork) == {"spawn", "fetch"}
    spawn, fetch = spans["spawn"], spans["fetch"]
    assert spawn.end_time is not None and fetch.start_time is not None and spawn.end_time <= fetch.start_time


async def test_a_hot_request_is_inference_and_encode_only(tmp: Path, tracer: OtelTracer,
                                                          exporter: InMemorySpanExporter) -> None:
    t = await _traced(tmp, tracer, exporter)
    await t.post()
    t.take()
    await t.post()
    spans = t.take()
    root = spans["POST /v2/models/{model}/infer"]
    assert root.attributes is not None and root.attributes["ember.rung"] == "hot"
    assert _children(spans, root) == {"decode", "inference", "encode"}
    assert spans["inference"].status.status_code is StatusCode.UNSET


async def test_a_paused_instance_is_resumed(tmp: Path, tracer: OtelTracer, exporter: InMemorySpanExporter) -> None:
    t = await _traced(tmp, tracer, exporter)
    await t.post()
    await t.world.run_for(3)
    assert t.world.node.paused
    t.take()
    await t.post()
    spans = t.take()
    root = spans["POST /v2/models/{model}/infer"]
    assert _children(spans, root) == {"decode", "resume", "inference", "encode"}
    assert spans["resume"].attributes is not None and spans["resume"].attributes["ember.rung"] == "paused"


async def test_a_request_that_waits_for_room_has_a_queue_wait(tmp: Path, tracer: OtelTracer,
                                                              exporter: InMemorySpanExporter) -> None:
    t = await _traced(tmp, tracer, exporter, slots=1, queue_wait_s=30)
    await t.post()
    t.world.node.infer_delay = 0.2
    busy = asyncio.ensure_future(t.post())
    while len(t.world.node.opened) < 2:   # the busy request holds the one instance
        await asyncio.sleep(0.01)
    exporter.clear()
    waited = await t.post()
    await busy
    roots = [s for s in exporter.get_finished_spans() if s.parent is None]
    assert waited.headers["ember-rung"] == "hot" and len(roots) == 2
    waits = [s for s in exporter.get_finished_spans() if s.name == "queue_wait"]
    assert len(waits) == 1 and waits[0].parent is not None
    assert waits[0].parent.span_id in {r.context.span_id for r in roots}


async def test_a_crash_mid_request_fails_its_inference_and_the_retry_forks_anew(
        tmp: Path, tracer: OtelTracer, exporter: InMemorySpanExporter) -> None:
    write(tmp, "m", max_scale=2)
    t = await _traced(tmp, tracer, exporter)
    first = await t.post()
    t.world.node.crash_next.add(first.headers["ember-instance"])
    exporter.clear()
    await t.post()
    spans = exporter.get_finished_spans()
    inferences = [s.status.status_code for s in spans if s.name == "inference"]
    assert sorted(inferences, key=str) == [StatusCode.ERROR, StatusCode.UNSET]
    assert [s.name for s in spans if s.name == "fork"] == ["fork"]


async def test_a_traceparent_makes_the_request_a_child_of_the_callers_span(
        tmp: Path, tracer: OtelTracer, exporter: InMemorySpanExporter) -> None:
    t = await _traced(tmp, tracer, exporter)
    await t.post(traceparent=f"00-{TRACE_ID}-{CALLER_SPAN}-01")
    spans = t.take()
    root = spans["POST /v2/models/{model}/infer"]
    assert root.parent is not None and root.parent.is_remote
    assert root.parent.span_id == int(CALLER_SPAN, 16)
    assert {s.context.trace_id for s in spans.values()} == {int(TRACE_ID, 16)}


async def test_a_background_job_adds_no_spans_to_the_request_that_queued_it(
        tmp: Path, tracer: OtelTracer, exporter: InMemorySpanExporter) -> None:
    t = await _traced(tmp, tracer, exporter)
    accepted = await t.post(prefer="respond-async")
    assert accepted.status_code == 202
    assert (await settle(t.world, accepted.json()["id"], "succeeded")).state == "succeeded"
    assert set(t.take()) == {"POST /v2/models/{model}/infer", "decode"}


async def test_an_error_marks_the_root_span(tmp: Path, tracer: OtelTracer, exporter: InMemorySpanExporter) -> None:
    t = await _traced(tmp, tracer, exporter)
    response = await t.client.post(INFER, content=b"{not json")
    assert response.status_code == 400
    spans = t.take()
    assert spans["decode"].status.status_code is StatusCode.ERROR
    root = spans["POST /v2/models/{model}/infer"]
    assert root.attributes is not None and root.attributes["http.response.status_code"] == 400


async def test_a_streams_root_span_ends_with_its_last_event(tmp_path: Path, tracer: OtelTracer,
                                                           exporter: InMemorySpanExporter) -> None:
    with JobStore(tmp_path / "jobs.sqlite3", max_queued=3, result_ttl_s=60) as jobs:
        app = create_app(FakeService(jobs=jobs), Metrics(), tracer=tracer)
        roots_at_each_event: list[int] = []

        async def send(message: dict[str, object]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                roots_at_each_event.append(sum(s.parent is None for s in exporter.get_finished_spans()))

        await _asgi_post(app, "/v2/models/chatter/generate_stream", {"text_input": "red green blue"}, send)
    assert len(roots_at_each_event) >= 3 and set(roots_at_each_event) == {0}
    root = next(s for s in exporter.get_finished_spans() if s.parent is None)
    assert root.name == "POST /v2/models/{model}/generate_stream"


async def _asgi_post(app: object, path: str, body: dict[str, object], send: object) -> None:
    """Drive the ASGI app by hand: httpx's ASGITransport hands back a body only once the app is done with it."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "server": ("ember", 80), "client": ("test", 1)}
    sent = asyncio.Event()
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict[str, object]:
        if messages:
            return messages.pop()
        await sent.wait()
        return {"type": "http.disconnect"}

    async def sending(message: dict[str, object]) -> None:
        await send(message)  # type: ignore[operator]
        if message["type"] == "http.response.body" and not message.get("more_body"):
            sent.set()

    await app(scope, receive, sending)  # type: ignore[operator]


def test_the_environment_turns_traces_on(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert not ServeConfig().otel
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert ServeConfig().otel
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not ServeConfig().otel
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    assert ServeConfig().otel
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not ServeConfig().otel


def test_the_exporters_are_the_ones_the_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    exporting_provider().shutdown()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(InvalidInput, match="zipkin"):
        exporting_provider()
