"""The trace context a forwarded request carries (`OtelTracer.context_headers`): the forwarding gateway's request
span, in the caller's trace, so the serving node's spans are its children."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider

from ember.gateway.context import NoRequestTracer
from ember.tracing import OtelTracer

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def test_inside_a_request_the_headers_name_its_span_in_the_callers_trace() -> None:
    tracer = OtelTracer(TracerProvider())
    with tracer.request("POST /v2/models/m/infer", {"traceparent": CALLER}) as span:
        version, trace_id, span_id, flags = tracer.context_headers()["traceparent"].split("-")
        span.end()
    assert (version, trace_id, flags) == ("00", TRACE_ID, "01")
    assert span_id != "00f067aa0ba902b7"   # the gateway's own span, a child of the caller's
    assert "traceparent" not in tracer.context_headers()   # outside a request: nothing to continue


def test_with_tracing_off_there_are_none_and_the_callers_own_are_passed_on() -> None:
    assert NoRequestTracer().context_headers() == {}
