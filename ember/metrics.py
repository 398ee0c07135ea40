"""Prometheus metrics of one ember server, in a registry of its own (tests make many)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ember.core.states import Rung

# 0.5 ms .. 30 s: a hot request is around a millisecond, a fetch from a remote origin tens of seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """Owns a CollectorRegistry; the gateway and the controller report through its methods."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("ember_requests", "HTTP requests answered", ["model", "api", "code"], registry=r)
        self.request_duration = Histogram(
            "ember_request_duration_seconds", "Time from request to response", ["model", "api"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.time_to_ready = Histogram(
            "ember_ladder_time_to_ready_seconds", "Time until an instance could take the request, per ladder rung",
            ["rung"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.time_to_first_response = Histogram(
            "ember_ladder_time_to_first_response_seconds", "Time until the first response, per ladder rung",
            ["rung"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.instances = Gauge("ember_instances", "Instances per model and state", ["model", "state"], registry=r)
        self.jobs_queued = Gauge("ember_jobs_queued", "Durable jobs waiting for capacity", registry=r)
        self.cold_starts = Counter("ember_cold_starts", "Requests that started an instance", ["model", "rung"],
                                   registry=r)
        self.worker_crashes = Counter("ember_worker_crashes", "Instances that died", ["model"], registry=r)
        self.time_to_first_token = Histogram(
            "ember_time_to_first_token_seconds", "Generation: request to first streamed token", ["model", "rung"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(
            "ember_time_per_output_token_seconds", "Generation: time per streamed token after the first",
            ["model", "rung"], buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("ember_generation_tokens", "Generation tokens", ["model", "kind"], registry=r)
        self.prefix_hits = Counter("ember_prefix_cache_hits", "Generations whose prompt began with cached KV",
                                   ["model"], registry=r)
        self.streams = Gauge("ember_streams_in_flight", "Generation streams being sent", ["model"], registry=r)

    def observe_request(self, model: str, api: str, code: int, duration_s: float) -> None:
        self.requests.labels(model=model, api=api, code=str(code)).inc()
        self.request_duration.labels(model=model, api=api).observe(duration_s)

    def observe_ladder(self, rung: Rung, time_to_ready_s: float | None, time_to_first_response_s: float) -> None:
        """time_to_ready_s is None where the rung had no instance to make ready (queued)."""
        if time_to_ready_s is not None:
            self.time_to_ready.labels(rung=rung.value).observe(time_to_ready_s)
        self.time_to_first_response.labels(rung=rung.value).observe(time_to_first_response_s)

    def set_instances(self, model: str, state: str, n: int) -> None:
        self.instances.labels(model=model, state=state).set(n)

    def set_jobs_queued(self, n: int) -> None:
        self.jobs_queued.set(n)

    def cold_start(self, model: str, rung: Rung) -> None:
        self.cold_starts.labels(model=model, rung=rung.value).inc()

    def worker_crash(self, model: str) -> None:
        self.worker_crashes.labels(model=model).inc()

    def stream_started(self, model: str, rung: Rung, first_token_s: float) -> None:
        self.streams.labels(model=model).inc()
        self.time_to_first_token.labels(model=model, rung=rung.value).observe(first_token_s)

    def stream_ended(self, model: str) -> None:
        self.streams.labels(model=model).dec()

    def output_tokens(self, model: str, rung: Rung, tokens: int, seconds: float) -> None:
        """`tokens` more streamed after the first, over `seconds`."""
        if tokens > 0:
            self.time_per_output_token.labels(model=model, rung=rung.value).observe(seconds / tokens)

    def generated(self, model: str, usage: Mapping[str, Any]) -> None:
        """A finished generation's tokens; `usage` as OpenAI shapes it (cached: prompt_tokens_details)."""
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        self.tokens.labels(model=model, kind="prompt").inc(int(usage.get("prompt_tokens", 0)))
        self.tokens.labels(model=model, kind="completion").inc(int(usage.get("completion_tokens", 0)))
        self.tokens.labels(model=model, kind="cached_prompt").inc(cached)
        if cached:
            self.prefix_hits.labels(model=model).inc()

    def text(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
