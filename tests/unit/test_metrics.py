"""Metrics: separate registries, every series the brief names, Prometheus text format."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from ember.core.states import Rung
from ember.metrics import LATENCY_BUCKETS, Metrics


def samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(m.text().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_registries_are_independent() -> None:
    a, b = Metrics(), Metrics()
    a.observe_request("affine:1", "v2", 200, 0.01)
    key = ("ember_requests_total", (("api", "v2"), ("code", "200"), ("model", "affine"), ("version", "1")))
    assert samples(a)[key] == 1
    assert key not in samples(b)


def mv(*extra: tuple[str, str], model: str = "embedder", version: str = "2") -> tuple[tuple[str, str], ...]:
    return tuple(sorted([("model", model), ("version", version), *extra]))


def test_every_series_is_exposed_with_model_and_version_labels() -> None:
    m = Metrics()
    m.observe_request("embedder:2", "openai", 429, 0.002)
    m.observe_request("embedder:2", "openai", 429, 0.003)
    m.observe_request("", "v2", 404, 0.001)
    m.observe_ladder("embedder:2", Rung.TEMPLATE, 0.04, 0.05)
    m.observe_ladder("embedder:2", Rung.QUEUED, None, 3.0)
    m.set_instances("embedder:2", "idle", 3)
    m.set_instances("embedder:2", "idle", 2)
    m.set_jobs("embedder:2", 7, 12.5)
    m.job("embedder:2", "submitted")
    m.cold_start("embedder:2", Rung.ZYGOTE, {"spawn": 0.01, "load": 0.2, "warmup": 0.05})
    m.first_response("embedder:2", Rung.ZYGOTE, 0.004)
    m.instance_event("embedder:2", "pause")
    m.worker_crash("embedder:2")
    m.set_load("embedder:2", in_flight=5, waiting=2, desired=3, panic=True)
    m.set_memory("embedder:2", 123_000_000)
    s = samples(m)
    assert s[("ember_requests_total", mv(("api", "openai"), ("code", "429")))] == 2
    assert s[("ember_requests_total", mv(("api", "v2"), ("code", "404"), model="", version=""))] == 1
    assert s[("ember_request_duration_seconds_count", mv(("api", "openai")))] == 2
    assert s[("ember_ladder_time_to_ready_seconds_count", mv(("rung", "template")))] == 1
    assert ("ember_ladder_time_to_ready_seconds_count", mv(("rung", "queued"))) not in s
    assert s[("ember_ladder_time_to_first_response_seconds_sum", mv(("rung", "queued")))] == 3.0
    assert s[("ember_instances", mv(("state", "idle")))] == 2
    assert s[("ember_jobs_queued", mv())] == 7 and s[("ember_jobs_oldest_age_seconds", mv())] == 12.5
    assert s[("ember_jobs_total", mv(("outcome", "submitted")))] == 1
    assert s[("ember_cold_starts_total", mv(("rung", "zygote")))] == 1
    for phase in ("spawn", "load", "warmup", "first_response"):
        assert s[("ember_cold_start_phase_seconds_count", mv(("phase", phase), ("rung", "zygote")))] == 1
    for event in ("fork", "pause", "crash"):
        assert s[("ember_instance_events_total", mv(("event", event)))] == 1
    assert s[("ember_worker_crashes_total", mv())] == 1
    assert s[("ember_requests_in_flight", mv())] == 5 and s[("ember_queue_depth", mv())] == 2
    assert s[("ember_autoscaler_desired_instances", mv())] == 3 and s[("ember_autoscaler_panic", mv())] == 1
    assert s[("ember_instance_memory_pss_bytes", mv())] == 123_000_000


def test_store_counters_follow_running_totals_and_never_go_down() -> None:
    m = Metrics()
    m.set_store({"memory": 10, "disk": 20}, fetched_bytes={"origin": 1000}, fetch_s=0.5)
    m.set_store({"memory": 5, "disk": 20}, fetched_bytes={"origin": 3000, "peer": 700}, fetch_s=1.5)
    m.set_store({"memory": 5, "disk": 20}, fetched_bytes={"origin": 0, "peer": 0}, fetch_s=0.0)   # a new store
    s = samples(m)
    assert s[("ember_store_bytes", (("tier", "memory"),))] == 5
    assert s[("ember_store_fetched_bytes_total", (("source", "origin"),))] == 3000
    assert s[("ember_store_fetched_bytes_total", (("source", "peer"),))] == 700
    assert s[("ember_store_fetch_seconds_total", ())] == 1.5


def test_buckets_span_half_a_millisecond_to_thirty_seconds() -> None:
    m = Metrics()
    m.observe_ladder("m:1", Rung.HOT, 0.0004, 0.0004)
    m.observe_ladder("m:1", Rung.FETCH, 25.0, 29.0)
    s = samples(m)

    def bucket(le: str, rung: str) -> float:
        return s[("ember_ladder_time_to_ready_seconds_bucket", mv(("le", le), ("rung", rung), model="m", version="1"))]

    assert bucket("0.0005", "hot") == 1 and bucket("20.0", "fetch") == 0 and bucket("30.0", "fetch") == 1
    assert LATENCY_BUCKETS[0] == 0.0005 and LATENCY_BUCKETS[-1] == 30.0
    assert list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS)
