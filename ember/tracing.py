"""OpenTelemetry traces: the adapter behind the gateway's `RequestTracer` (and the serving core's `Tracer`).

Part of the `ember[otel]` extra: only `ember.server` imports this module, and only when tracing is on
(`ember serve --otel`, or the OTel environment: see `ember.config` and docs/tracing.md), so ember runs
without the OpenTelemetry packages installed.

Spans take their times from OpenTelemetry's own clock (wall-clock nanoseconds, as every exporter expects),
not from the controller's `Clock`: they describe what happened, they decide nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from types import TracebackType

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

import ember
from ember.errors import InvalidInput
from ember.serving.ports import NO_SPAN, Attribute, Span

# An instance's start, in the order it happens (the node reports the phases in any order).
_PHASES = ("spawn", "fetch", "load", "warmup")


class OtelSpan:
    """A `Span` over an OpenTelemetry span."""

    __slots__ = ("_span", "_tracer")

    def __init__(self, tracer: trace.Tracer, span: trace.Span) -> None:
        self._tracer, self._span = tracer, span

    def set(self, key: str, value: Attribute) -> None:
        if self._span.is_recording():
            self._span.set_attribute(key, value)

    def phases(self, seconds: Mapping[str, float]) -> None:
        """One child span per phase, laid end to end so that the last ends now (when the start returned);
        each is also an attribute (`ember.phase.NAME_s`), for backends that show no child spans of a span."""
        end = time.time_ns()
        began = getattr(self._span, "start_time", None) or 0   # an SDK span's start: no child starts before it
        at = max(began, end - sum(int(s * 1e9) for s in seconds.values()))
        parent = trace.set_span_in_context(self._span)
        for name in sorted(seconds, key=lambda n: _PHASES.index(n) if n in _PHASES else len(_PHASES)):
            until = min(end, at + int(seconds[name] * 1e9))
            self._tracer.start_span(name, context=parent, start_time=at).end(end_time=until)
            self.set(f"ember.phase.{name}_s", seconds[name])
            at = until

    def fail(self, message: str) -> None:
        if self._span.is_recording():
            self._span.set_status(Status(StatusCode.ERROR, message))

    def end(self) -> None:
        if self._span.is_recording():   # an ended span records nothing more: ending it twice is a no-op
            self._span.end()

    def __enter__(self) -> OtelSpan:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        if err is not None:
            self.fail(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__)
        self.end()


class OtelTracer:
    """The gateway's `RequestTracer` on an OpenTelemetry tracer provider (the global one when None)."""

    def __init__(self, provider: trace.TracerProvider | None = None) -> None:
        self._provider = provider
        self._tracer = trace.get_tracer("ember", ember.__version__, tracer_provider=provider)

    def start(self, name: str) -> Span:
        # Outside a request (a durable job, a tick) there is no trace to add to, and a lone span per step of
        # background work would be noise; a request its sampler dropped records nothing either.
        if not trace.get_current_span().is_recording():
            return NO_SPAN
        return OtelSpan(self._tracer, self._tracer.start_span(name))

    @contextlib.contextmanager
    def request(self, name: str, headers: Mapping[str, str]) -> Iterator[Span]:
        caller = propagate.extract(headers)   # W3C traceparent/tracestate (OTEL_PROPAGATORS can add others)
        span = self._tracer.start_span(name, context=caller, kind=SpanKind.SERVER)
        token = context.attach(trace.set_span_in_context(span, caller))
        try:
            yield OtelSpan(self._tracer, span)
        finally:
            context.detach(token)

    def context_headers(self) -> dict[str, str]:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)   # the current span (a request's, inside `request`), as W3C headers
        return carrier

    def close(self) -> None:
        """Export what is still buffered (at shutdown)."""
        shutdown = getattr(self._provider, "shutdown", None)
        if shutdown is not None:
            shutdown()


def exporting_provider() -> TracerProvider:
    """A provider that batches spans to the exporters OTEL_TRACES_EXPORTER names: `otlp` (the default: OTLP over
    HTTP/protobuf to OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, by default http://localhost:4318) and `console`."""
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or "ember",
                                "service.version": ember.__version__})
    provider = TracerProvider(resource=resource)   # its sampler follows OTEL_TRACES_SAMPLER
    for exporter in _exporters(os.environ.get("OTEL_TRACES_EXPORTER") or "otlp"):
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _exporters(names: str) -> list[SpanExporter]:
    out: list[SpanExporter] = []
    for name in (n.strip() for n in names.split(",")):
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            out.append(OTLPSpanExporter())   # reads the endpoint, headers and timeout from the environment
        elif name == "console":
            out.append(ConsoleSpanExporter())
        elif name not in ("", "none"):
            raise InvalidInput(f"OTEL_TRACES_EXPORTER: {name!r} is not one ember knows (otlp, console, none)")
    return out
