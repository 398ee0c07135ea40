"""The status page's data: a bounded ring of per-model samples, one a second over the last ten minutes.

Each sample is built from what the gateway already has, the service's status and a reading of the metrics
registry; counters and histograms are differenced against the previous reading, so a sample says what
happened in its interval (requests, their latency percentiles, the rungs they came from, cold starts).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ember.core.clock import Clock
from ember.gateway.readings import Key, Reading, delta, quantile
from ember.serving.results import ModelStatus

WINDOW_S = 600.0
INTERVAL_S = 1.0
PERCENTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}
OTHER = ""  # metrics under model="" (a request naming no deployed model, or a metric without the label)


@dataclass(frozen=True)
class Sample:
    t: float                        # the clock's seconds
    models: dict[str, dict[str, Any]]
    node_pss_bytes: int


def model_key(name: str, version: str) -> str:
    return f"{name}:{version}" if version else name


class Timeline:
    """Samples at most one per `interval_s`, keeps those of the last `window_s` (and at most window/interval)."""

    def __init__(self, clock: Clock, window_s: float = WINDOW_S, interval_s: float = INTERVAL_S) -> None:
        self.clock, self.window_s, self.interval_s = clock, window_s, interval_s
        self.samples: deque[Sample] = deque(maxlen=max(1, round(window_s / interval_s)))
        self._last: Reading | None = None
        self._last_t = float("-inf")

    def due(self) -> bool:
        # A little slack, so a poll that comes a hair early (timer jitter) still samples.
        return self.clock.now() - self._last_t >= self.interval_s * 0.9

    def add(self, status: list[ModelStatus], reading: Reading) -> Sample:
        """Record a sample; the first only sets the baseline for the counters (it shows no requests)."""
        now = self.clock.now()
        before = self._last if self._last is not None else reading
        models = {model_key(m.name, m.version): _model_sample(m, reading, before) for m in status}
        other = _metric_sample(reading, before, [(OTHER, OTHER)])
        if any(other.values()):
            models[OTHER] = other
        sample = Sample(now, models, node_pss_bytes(status))
        self.samples.append(sample)
        self._last, self._last_t = reading, now
        while self.samples and self.samples[0].t < now - self.window_s:
            self.samples.popleft()
        return sample

    def snapshot(self, status: list[ModelStatus]) -> dict[str, Any]:
        """The JSON the page polls: now, the models as they are, and the samples (oldest first)."""
        return {
            "now": self.clock.now(), "window_s": self.window_s, "interval_s": self.interval_s,
            "models": [_model_now(m) for m in status],
            "node": {"pss_bytes": node_pss_bytes(status), "slices": slices(status)},
            "samples": [{"t": s.t, "models": s.models, "node_pss_bytes": s.node_pss_bytes} for s in self.samples],
        }


def _model_sample(m: ModelStatus, now: Reading, before: Reading) -> dict[str, Any]:
    # A metric still without a version label (or without a model label at all) counts for every version.
    sample = _metric_sample(now, before, [(m.name, m.version), (m.name, "")] if m.version else [(m.name, "")])
    sample["state"] = m.state
    sample["instances"] = dict(Counter(str(i.get("state", "")) for i in m.instances))
    return sample


def _metric_sample(now: Reading, before: Reading, keys: Iterable[Key]) -> dict[str, Any]:
    keys = list(dict.fromkeys(keys))
    buckets = _sum(delta(now.buckets.get(k, {}), before.buckets.get(k, {})) for k in keys)
    out: dict[str, Any] = {"requests": int(max(buckets.values(), default=0))}
    out |= {name: quantile(q, buckets) for name, q in PERCENTILES.items()}
    out["rungs"] = _nonzero(_sum(delta(now.rungs.get(k, {}), before.rungs.get(k, {})) for k in keys))
    out["cold_starts"] = _nonzero(_sum(delta(now.cold_starts.get(k, {}), before.cold_starts.get(k, {})) for k in keys))
    out |= _sum(now.gauges.get(k, {}) for k in keys)
    return out


def _sum(parts: Iterable[Mapping[Any, float]]) -> dict[Any, float]:
    out: dict[Any, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _nonzero(counts: Mapping[str, float]) -> dict[str, int]:
    return {k: int(v) for k, v in counts.items() if v > 0}


def _model_now(m: ModelStatus) -> dict[str, Any]:
    instances = [{k: i.get(k) for k in ("id", "state", "rung", "slice", "inflight", "served", "pss_bytes")}
                 for i in m.instances]
    return {"key": model_key(m.name, m.version), "name": m.name, "version": m.version, "state": m.state,
            "template": m.template, "instances": instances}


def node_pss_bytes(status: list[ModelStatus]) -> int:
    """The instances' and templates' proportional set sizes summed: what the models cost this node."""
    total = 0
    for m in status:
        total += int((m.template or {}).get("pss_bytes") or 0)
        total += sum(int(i.get("pss_bytes") or 0) for i in m.instances)
    return total


def slices(status: list[ModelStatus]) -> list[dict[str, Any]]:
    """The slices in use, and whose they are (instances without a slice are left out)."""
    return [{"slice": i["slice"], "model": model_key(m.name, m.version), "instance": i.get("id"),
             "state": i.get("state")} for m in status for i in m.instances if i.get("slice")]
