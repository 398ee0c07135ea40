"""Prometheus metrics of one ember server, in a registry of its own (tests make many).

One label scheme (docs/metrics.md): `model` is the model's name and `version` its version, split here from the
`name:version` keys the gateway and the controller pass; `rung`, `api`, `state`, `event`, `phase`, `kind`,
`outcome` say the rest. A request that names no deployed model counts under `model=""`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ember.core.states import Rung

# 0.5 ms .. 30 s: a hot request is around a millisecond, a fetch from a remote origin tens of seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
MV = ["model", "version"]


def split_key(key: str) -> tuple[str, str]:
    """`name:version` -> (name, version); a bare name has version ""."""
    name, _, version = key.partition(":")
    return name, version


class Metrics:
    """Owns a CollectorRegistry; the gateway and the controller report through its methods."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        def histogram(name: str, doc: str, labels: list[str]) -> Histogram:
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=r)

        # Requests
        self.requests = Counter("ember_requests", "Requests answered, HTTP and gRPC (api grpc; code: the HTTP "
                                "status its error has)", [*MV, "api", "code"], registry=r)
        self.request_duration = histogram("ember_request_duration_seconds", "Time from request to response",
                                          [*MV, "api"])
        self.in_flight = Gauge("ember_requests_in_flight", "Requests in the model's instances plus those waiting "
                               "for room (the autoscaler's concurrency)", MV, registry=r)
        self.queue_depth = Gauge("ember_queue_depth", "Requests waiting for room in an instance", MV, registry=r)
        # The ladder
        self.time_to_ready = histogram("ember_ladder_time_to_ready_seconds",
                                       "Time until an instance could take the request, per ladder rung", [*MV, "rung"])
        self.time_to_first_response = histogram("ember_ladder_time_to_first_response_seconds",
                                                "Time until the first response, per ladder rung", [*MV, "rung"])
        self.cold_starts = Counter("ember_cold_starts", "Instances started (fork or fetch)", [*MV, "rung"],
                                   registry=r)
        self.phases = histogram("ember_cold_start_phase_seconds", "Phases of an instance start: spawn, fetch, load, "
                                "warmup, restore, first_response", [*MV, "rung", "phase"])
        self.events = Counter("ember_instance_events", "Instance lifecycle events: pause, resume, sleep, wake, "
                              "recycle, evict, fork, fetch, crash", [*MV, "event"], registry=r)
        self.instances = Gauge("ember_instances", "Instances per model and state", [*MV, "state"], registry=r)
        self.desired = Gauge("ember_autoscaler_desired_instances", "The autoscaler's desired instances", MV,
                             registry=r)
        self.panic = Gauge("ember_autoscaler_panic", "1 while the autoscaler is in panic mode", MV, registry=r)
        self.worker_crashes = Counter("ember_worker_crashes", "Instances that died", MV, registry=r)
        self.pss = Gauge("ember_instance_memory_pss_bytes", "PSS of the model's template and instances", MV,
                         registry=r)
        # Jobs
        self.jobs_queued = Gauge("ember_jobs_queued", "Durable jobs waiting for capacity", MV, registry=r)
        self.jobs_oldest = Gauge("ember_jobs_oldest_age_seconds", "Age of the oldest queued job (0: none)", MV,
                                 registry=r)
        self.jobs = Counter("ember_jobs", "Durable jobs by outcome: submitted, completed, failed", [*MV, "outcome"],
                            registry=r)
        # Weight store
        self.store_bytes = Gauge("ember_store_bytes", "Bytes held by a weight-store tier", ["tier"], registry=r)
        self.fetched = Counter("ember_store_fetched_bytes", "Chunk bytes fetched, by source: peer or origin",
                               ["source"], registry=r)
        self.fetch_seconds = Counter("ember_store_fetch_seconds", "Seconds spent fetching from the origin",
                                     registry=r)
        # Text generation
        self.time_to_first_token = histogram("ember_time_to_first_token_seconds",
                                             "Generation: request to first streamed token", [*MV, "rung"])
        self.time_per_output_token = histogram("ember_time_per_output_token_seconds",
                                               "Generation: time per streamed token after the first", [*MV, "rung"])
        self.tokens = Counter("ember_generation_tokens", "Generation tokens", [*MV, "kind"], registry=r)
        self.prefix_hits = Counter("ember_prefix_cache_hits", "Generations whose prompt began with cached KV", MV,
                                   registry=r)
        self.streams = Gauge("ember_streams_in_flight", "Generation streams being sent", MV, registry=r)

    # --- requests (the gateway) --------------------------------------------------------------

    def observe_request(self, model: str, api: str, code: int, duration_s: float) -> None:
        name, version = split_key(model)
        self.requests.labels(name, version, api, str(code)).inc()
        self.request_duration.labels(name, version, api).observe(duration_s)

    # --- the ladder (the controller) ---------------------------------------------------------

    def observe_ladder(self, model: str, rung: Rung, time_to_ready_s: float | None,
                       time_to_first_response_s: float) -> None:
        """time_to_ready_s is None where the rung had no instance to make ready (queued)."""
        mv = split_key(model)
        if time_to_ready_s is not None:
            self.time_to_ready.labels(*mv, rung.value).observe(time_to_ready_s)
        self.time_to_first_response.labels(*mv, rung.value).observe(time_to_first_response_s)

    def cold_start(self, model: str, rung: Rung, phases: Mapping[str, float]) -> None:
        """An instance started on `rung` (template, zygote, restore or fetch), with the seconds of each phase."""
        mv = split_key(model)
        self.cold_starts.labels(*mv, rung.value).inc()
        self.events.labels(*mv, "fetch" if rung is Rung.FETCH else "fork").inc()
        for phase, seconds in phases.items():
            self.phases.labels(*mv, rung.value, phase).observe(max(0.0, seconds))

    def first_response(self, model: str, rung: Rung, seconds: float) -> None:
        """The first request on an instance that was started for it: the last phase of its cold start."""
        self.phases.labels(*split_key(model), rung.value, "first_response").observe(seconds)

    def instance_event(self, model: str, event: str) -> None:
        self.events.labels(*split_key(model), event).inc()

    def worker_crash(self, model: str) -> None:
        mv = split_key(model)
        self.worker_crashes.labels(*mv).inc()
        self.events.labels(*mv, "crash").inc()

    def set_instances(self, model: str, state: str, n: int) -> None:
        self.instances.labels(*split_key(model), state).set(n)

    def set_load(self, model: str, in_flight: int, waiting: int, desired: int, panic: bool) -> None:
        """The autoscaler's view of a model on a tick."""
        mv = split_key(model)
        self.in_flight.labels(*mv).set(in_flight)
        self.queue_depth.labels(*mv).set(waiting)
        self.desired.labels(*mv).set(desired)
        self.panic.labels(*mv).set(1 if panic else 0)

    def set_memory(self, model: str, pss_bytes: int) -> None:
        self.pss.labels(*split_key(model)).set(pss_bytes)

    # --- jobs ---------------------------------------------------------------------------------

    def set_jobs(self, model: str, queued: int, oldest_age_s: float) -> None:
        mv = split_key(model)
        self.jobs_queued.labels(*mv).set(queued)
        self.jobs_oldest.labels(*mv).set(oldest_age_s)

    def job(self, model: str, outcome: str) -> None:
        self.jobs.labels(*split_key(model), outcome).inc()

    # --- weight store -------------------------------------------------------------------------

    def set_store(self, tier_bytes: Mapping[str, int], fetched_bytes: Mapping[str, int], fetch_s: float) -> None:
        """Tier sizes now, and the store's running fetch totals, bytes by source (counters only move forward)."""
        for tier, size in tier_bytes.items():
            self.store_bytes.labels(tier).set(size)
        for source, total in fetched_bytes.items():
            _advance(self.fetched.labels(source), total)
        _advance(self.fetch_seconds, fetch_s)

    # --- text generation (the gateway) -----------------------------------------------------------

    def stream_started(self, model: str, rung: Rung, first_token_s: float) -> None:
        mv = split_key(model)
        self.streams.labels(*mv).inc()
        self.time_to_first_token.labels(*mv, rung.value).observe(first_token_s)

    def stream_ended(self, model: str) -> None:
        self.streams.labels(*split_key(model)).dec()

    def output_tokens(self, model: str, rung: Rung, tokens: int, seconds: float) -> None:
        """`tokens` more streamed after the first, over `seconds`."""
        if tokens > 0:
            self.time_per_output_token.labels(*split_key(model), rung.value).observe(seconds / tokens)

    def generated(self, model: str, usage: Mapping[str, Any]) -> None:
        """A finished generation's tokens; `usage` as OpenAI shapes it (cached: prompt_tokens_details)."""
        mv = split_key(model)
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        self.tokens.labels(*mv, "prompt").inc(int(usage.get("prompt_tokens", 0)))
        self.tokens.labels(*mv, "completion").inc(int(usage.get("completion_tokens", 0)))
        self.tokens.labels(*mv, "cached_prompt").inc(cached)
        if cached:
            self.prefix_hits.labels(*mv).inc()

    def text(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


def _advance(counter: Counter, total: float) -> None:
    """Move a counter (or one labelled child of it) up to a running total kept elsewhere (never down)."""
    current = counter._value.get()   # prometheus_client has no public read of a counter's value
    if total > current:
        counter.inc(total - current)
