"""One reading of the Prometheus registry, by metric name (docs/metrics.md), and percentiles from its histograms.

The status page reads the registry it already has rather than adding hooks to the request path. Metrics are
looked up by sample name and their `model` and `version` labels; a missing label reads as "", so a metric that
has not (yet) got a label is still counted, under the empty model.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from prometheus_client import CollectorRegistry

Key = tuple[str, str]  # (model, version)
K = TypeVar("K", str, float)

REQUEST_BUCKETS = "ember_request_duration_seconds_bucket"
# Route families that are not inference: the page's own polls, scrapes and probes would swamp the model="" latency.
NOT_INFERENCE = {"ui", "ops", "health"}
LADDER_COUNTS = "ember_ladder_time_to_first_response_seconds_count"
COLD_STARTS = "ember_cold_starts_total"
# Gauges the page plots as they are: sample name -> the field it fills.
GAUGES = {
    "ember_jobs_queued": "jobs_queued",
    "ember_jobs_oldest_age_seconds": "jobs_oldest_age_s",
    "ember_requests_in_flight": "in_flight",
    "ember_queue_depth": "queue_depth",
    "ember_instance_memory_pss_bytes": "pss_bytes",
}


@dataclass
class Reading:
    """Cumulative values at one moment, per (model, version)."""

    buckets: dict[Key, dict[float, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    rungs: dict[Key, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    cold_starts: dict[Key, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    gauges: dict[Key, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))

    def models(self) -> set[Key]:
        """Every (model, version) some metric names."""
        return {*self.buckets, *self.rungs, *self.cold_starts, *self.gauges}


@dataclass(frozen=True)
class Sample:
    """The part of a registry sample the page needs."""

    name: str
    labels: Mapping[str, str]
    value: float


def read(registry: CollectorRegistry) -> Reading:
    return reading_of(Sample(s.name, s.labels, s.value) for family in registry.collect() for s in family.samples)


def reading_of(samples: Iterable[Sample]) -> Reading:
    """Sum the samples the page uses by (model, version); other labels (api, code, ...) are summed over."""
    out = Reading()
    for s in samples:
        key = _key(s.labels)
        if s.name == REQUEST_BUCKETS and s.labels.get("api") not in NOT_INFERENCE:
            out.buckets[key][float(s.labels.get("le", "+Inf"))] += s.value
        elif s.name == LADDER_COUNTS:
            out.rungs[key][s.labels.get("rung", "")] += s.value
        elif s.name == COLD_STARTS:
            out.cold_starts[key][s.labels.get("rung", "")] += s.value
        elif s.name in GAUGES:
            out.gauges[key][GAUGES[s.name]] += s.value
    return out


def _key(labels: Mapping[str, str]) -> Key:
    model, version = labels.get("model", ""), labels.get("version", "")
    if not version and ":" in model:   # model="name:version", as some metrics were labelled before docs/metrics.md
        model, _, version = model.partition(":")
    return model, version


def delta(now: Mapping[K, float], before: Mapping[K, float]) -> dict[K, float]:
    """now - before per entry, for cumulative counts. A count that went down was reset: its new value is the delta."""
    out = {}
    for k, v in now.items():
        d = v - before.get(k, 0.0)
        out[k] = d if d >= 0 else v
    return out


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile of cumulative bucket counts {upper bound: count}, interpolated within its bucket as
    Prometheus' histogram_quantile does; None without observations. In the +Inf bucket: the highest finite bound."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank and count > below:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower
