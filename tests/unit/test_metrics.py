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
    a.observe_request("affine", "v2", 200, 0.01)
    assert samples(a)[("ember_requests_total", (("api", "v2"), ("code", "200"), ("model", "affine")))] == 1
    assert ("ember_requests_total", (("api", "v2"), ("code", "200"), ("model", "affine"))) not in samples(b)


def test_every_series_is_exposed_with_labels() -> None:
    m = Metrics()
    m.observe_request("embedder", "openai", 429, 0.002)
    m.observe_request("embedder", "openai", 429, 0.003)
    m.observe_ladder(Rung.TEMPLATE, 0.04, 0.05)
    m.observe_ladder(Rung.QUEUED, None, 3.0)
    m.set_instances("embedder", "idle", 3)
    m.set_instances("embedder", "idle", 2)
    m.set_jobs_queued(7)
    m.cold_start("embedder", Rung.ZYGOTE)
    m.worker_crash("embedder")
    s = samples(m)
    assert s[("ember_requests_total", (("api", "openai"), ("code", "429"), ("model", "embedder")))] == 2
    assert s[("ember_request_duration_seconds_count", (("api", "openai"), ("model", "embedder")))] == 2
    assert s[("ember_ladder_time_to_ready_seconds_count", (("rung", "template"),))] == 1
    assert ("ember_ladder_time_to_ready_seconds_count", (("rung", "queued"),)) not in s
    assert s[("ember_ladder_time_to_first_response_seconds_sum", (("rung", "queued"),))] == 3.0
    assert s[("ember_instances", (("model", "embedder"), ("state", "idle")))] == 2
    assert s[("ember_jobs_queued", ())] == 7
    assert s[("ember_cold_starts_total", (("model", "embedder"), ("rung", "zygote")))] == 1
    assert s[("ember_worker_crashes_total", (("model", "embedder"),))] == 1


def test_buckets_span_half_a_millisecond_to_thirty_seconds() -> None:
    m = Metrics()
    m.observe_ladder(Rung.HOT, 0.0004, 0.0004)
    m.observe_ladder(Rung.FETCH, 25.0, 29.0)
    s = samples(m)
    assert s[("ember_ladder_time_to_ready_seconds_bucket", (("le", "0.0005"), ("rung", "hot")))] == 1
    assert s[("ember_ladder_time_to_ready_seconds_bucket", (("le", "20.0"), ("rung", "fetch")))] == 0
    assert s[("ember_ladder_time_to_ready_seconds_bucket", (("le", "30.0"), ("rung", "fetch")))] == 1
    assert LATENCY_BUCKETS[0] == 0.0005 and LATENCY_BUCKETS[-1] == 30.0
    assert list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS)
