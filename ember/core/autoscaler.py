"""The per-model autoscaler: Knative's KPA algorithm as a pure decision over recorded concurrency.

Metrics -> decision -> actuation are separate: the caller records concurrency samples
(`record`), asks for a decision (`decide`) with the number of ready instances, and acts
on the returned `ScaleDecision` itself. Time is always passed in as `now` (seconds on
any monotonic clock), so the same object runs under the live server's clock and the
simulator's.

The algorithm follows knative.dev/serving pkg/autoscaler/scaling (KPA):
- concurrency is averaged over a stable window (60 s) and a panic window (10% of it);
- desired = ceil(average / (target * utilization));
- panic starts when the panic desire reaches `panic_threshold_pct` of the ready instances,
  lasts until a full stable window passes without that, and never scales down;
- scale-up and scale-down are rate limited relative to the ready instances;
- a scale-down waits for `scale_down_delay_s` (the maximum desire over that window wins);
- zero is reached only after `scale_to_zero_grace_s` without any desire;
- a request arriving at zero gets an immediate desire of at least one (`activate`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ember.errors import InvalidInput

# Knative buckets its metrics per second; finer samples within a second are averaged.
_BUCKET_S = 1.0


class AutoscalerConfig(BaseModel):
    """Named, validated knobs; defaults are Knative's (config-autoscaler) unless a contract overrides them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target_concurrency: float = Field(default=100.0, gt=0, le=10_000, description="in-flight requests per instance")
    target_utilization_pct: float = Field(default=70.0, gt=0, le=100, description="share of the target to aim at")
    stable_window_s: float = Field(default=60.0, ge=6, le=3600)
    panic_window_pct: float = Field(default=10.0, ge=1, le=100)
    panic_threshold_pct: float = Field(default=200.0, gt=100, le=1000)
    max_scale_up_rate: float = Field(default=1000.0, gt=1)
    max_scale_down_rate: float = Field(default=2.0, gt=1)
    scale_down_delay_s: float = Field(default=0.0, ge=0, le=3600)
    scale_to_zero_grace_s: float = Field(default=30.0, ge=0, le=3600)
    enable_scale_to_zero: bool = True
    min_scale: int = Field(default=0, ge=0, le=1000)
    max_scale: int = Field(default=0, ge=0, le=1000, description="0 means unbounded (Knative's default)")
    initial_scale: int = Field(default=1, ge=0, le=1000)

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalerConfig:
        if self.max_scale and self.min_scale > self.max_scale:
            raise ValueError(f"min_scale ({self.min_scale}) exceeds max_scale ({self.max_scale})")
        if self.max_scale and self.initial_scale > self.max_scale:
            raise ValueError(f"initial_scale ({self.initial_scale}) exceeds max_scale ({self.max_scale})")
        if self.initial_scale == 0 and not self.enable_scale_to_zero:
            raise ValueError("initial_scale 0 needs enable_scale_to_zero")
        return self

    @property
    def panic_window_s(self) -> float:
        return max(_BUCKET_S, self.stable_window_s * self.panic_window_pct / 100.0)

    @property
    def target(self) -> float:
        """Concurrency per instance the autoscaler aims at (target x utilization)."""
        return self.target_concurrency * self.target_utilization_pct / 100.0

    @classmethod
    def parse(cls, data: dict[str, Any], where: str = "autoscaler") -> AutoscalerConfig:
        """Validate a mapping; raise InvalidInput naming each bad knob and its range."""
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            parts = [f"{'.'.join(str(p) for p in e['loc']) or '(config)'}: {e['msg']}" for e in err.errors()]
            raise InvalidInput(f"{where}: " + "; ".join(parts)) from None

    @classmethod
    def from_contract(cls, contract: Any, **overrides: Any) -> AutoscalerConfig:
        """Knative defaults, with the contract's `scaling` section (and any overrides) on top."""
        s = contract.scaling
        data: dict[str, Any] = {
            "min_scale": s.min_scale, "max_scale": s.max_scale,
            "initial_scale": s.min_scale if s.initial_scale is None else s.initial_scale,
            "target_concurrency": s.target_concurrency,
        }
        data.update(overrides)
        return cls.parse(data, where=f"{getattr(contract, 'key', 'contract')}: scaling")


@dataclass(frozen=True)
class ScaleDecision:
    """What the autoscaler wants and why; `desired` is final (bounds and rates applied)."""

    desired: int
    panic: bool
    reason: str                 # "stable", "panic", "activation", "no-data", "initial", "grace", ...
    stable_concurrency: float   # averaged over the stable window
    panic_concurrency: float    # averaged over the panic window
    desired_stable: int         # ceil(stable average / target), before rates and bounds
    desired_panic: int          # ceil(panic average / target), before rates and bounds
    ready: int


class _WindowAverage:
    """Per-second buckets of concurrency; the window average treats empty seconds as zero."""

    def __init__(self, horizon_s: float) -> None:
        self._horizon = horizon_s
        self._buckets: deque[tuple[int, float, int]] = deque()  # (second, sum, count)
        self.first: float | None = None

    def add(self, now: float, value: float) -> None:
        sec = math.floor(now / _BUCKET_S)
        if self.first is None:
            self.first = now
        if self._buckets and self._buckets[-1][0] == sec:
            _, total, count = self._buckets[-1]
            self._buckets[-1] = (sec, total + value, count + 1)
        elif self._buckets and self._buckets[-1][0] > sec:
            raise InvalidInput(f"concurrency sample at {now} is older than the last one")
        else:
            self._buckets.append((sec, value, 1))
        while self._buckets and self._buckets[0][0] <= sec - self._horizon / _BUCKET_S - 1:
            self._buckets.popleft()

    def average(self, now: float, window_s: float) -> float | None:
        """Mean over the window (or over the history when it is shorter); None with no data in it."""
        if self.first is None:
            return None
        sec = math.floor(now / _BUCKET_S)
        n_window = max(1, round(window_s / _BUCKET_S))
        lo = sec - n_window + 1
        in_window = [total / count for s, total, count in self._buckets if lo <= s <= sec]
        if not in_window:
            return None
        covered = min(n_window, sec - math.floor(self.first / _BUCKET_S) + 1)
        return sum(in_window) / max(1, covered)


class Autoscaler:
    """One model's KPA. Call `record` with each concurrency sample and `decide` on each tick."""

    def __init__(self, config: AutoscalerConfig | None = None, *, created_at: float | None = None) -> None:
        self.config = config or AutoscalerConfig()
        self._metrics = _WindowAverage(self.config.stable_window_s)
        self._created_at = created_at
        self._panic_since: float | None = None   # last time the panic condition held
        self._max_panic = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, desire) for the scale-down delay
        self._zero_since: float | None = None     # when the desire last dropped to zero
        self._initial_reached = self.config.initial_scale == 0

    @property
    def in_panic(self) -> bool:
        return self._panic_since is not None

    def record(self, now: float, concurrency: float) -> None:
        """One sample of in-flight plus queued requests for this model."""
        if concurrency < 0 or not math.isfinite(concurrency):
            raise InvalidInput(f"concurrency must be a finite number >= 0, got {concurrency}")
        if self._created_at is None:
            self._created_at = now
        self._metrics.add(now, concurrency)

    def activate(self, now: float, ready: int = 0) -> ScaleDecision:
        """A request arrived while no instance is ready: decide at once, never zero."""
        self.record(now, 1.0)
        self._zero_since = None
        want = max(1, self.config.min_scale, ready)
        if self.config.max_scale:
            want = min(want, self.config.max_scale)
        stable = self._metrics.average(now, self.config.stable_window_s) or 0.0
        return ScaleDecision(want, self.in_panic, "activation", stable, stable, want, want, ready)

    def decide(self, now: float, ready: int) -> ScaleDecision:
        """The desired instance count now, given `ready` instances serving."""
        cfg = self.config
        if self._created_at is None:
            self._created_at = now
        if ready >= cfg.initial_scale:
            self._initial_reached = True
        stable = self._metrics.average(now, cfg.stable_window_s)
        panic_avg = self._metrics.average(now, cfg.panic_window_s)
        if stable is None:
            return self._no_data(now, ready)
        return self._from_metrics(now, ready, stable, panic_avg or 0.0)

    def _no_data(self, now: float, ready: int) -> ScaleDecision:
        """Knative keeps the current scale while it has no metrics (e.g. just after a restart)."""
        want = ready if self._initial_reached else max(ready, self.config.initial_scale)
        return self._finish(now, ready, want, "no-data", 0.0, 0.0, 0, 0, panic=False)

    def _from_metrics(self, now: float, ready: int, stable: float, panic_avg: float) -> ScaleDecision:
        cfg = self.config
        desired_stable = math.ceil(stable / cfg.target - 1e-9)
        desired_panic = math.ceil(panic_avg / cfg.target - 1e-9)
        base = max(1, ready)  # Knative rates and the panic test use at least one pod
        up_limit = math.ceil(cfg.max_scale_up_rate * base)
        down_limit = math.floor(base / cfg.max_scale_down_rate)
        d_stable = min(max(desired_stable, down_limit), up_limit)
        d_panic = min(max(desired_panic, down_limit), up_limit)
        # Knative's test is on the pods the panic average asks for (rounded up), per ready pod.
        if desired_panic / base >= cfg.panic_threshold_pct / 100.0:
            self._panic_since = now
        elif self._panic_since is not None and now - self._panic_since >= cfg.stable_window_s:
            self._panic_since, self._max_panic = None, 0
        if self._panic_since is not None:
            # As Knative: provision for the larger of the two desires, and never scale down while panicking.
            want = max(d_stable, d_panic, self._max_panic)
            self._max_panic = want
            reason = "panic"
        else:
            want, reason = d_stable, "stable"
        return self._finish(now, ready, want, reason, stable, panic_avg, desired_stable, desired_panic,
                            panic=self._panic_since is not None)

    def _finish(self, now: float, ready: int, want: int, reason: str, stable: float, panic_avg: float,
                desired_stable: int, desired_panic: int, *, panic: bool) -> ScaleDecision:
        cfg = self.config
        want, reason = self._delay_scale_down(now, want, reason)
        if want > 0:
            self._zero_since = None
        else:
            # Zero only after the desire has stayed zero for the whole grace period.
            self._zero_since = now if self._zero_since is None else self._zero_since
            if now - self._zero_since < cfg.scale_to_zero_grace_s and ready > 0:
                want, reason = 1, "grace"
        if not cfg.enable_scale_to_zero:
            want = max(want, 1)
        if not self._initial_reached:
            want, reason = max(want, cfg.initial_scale), "initial" if want < cfg.initial_scale else reason
        want = max(want, cfg.min_scale)
        if cfg.max_scale:
            want = min(want, cfg.max_scale)
        return ScaleDecision(want, panic, reason, stable, panic_avg, desired_stable, desired_panic, ready)

    def _delay_scale_down(self, now: float, want: int, reason: str) -> tuple[int, str]:
        """Knative's scale-down delay: the largest desire seen over the delay window wins."""
        delay = self.config.scale_down_delay_s
        if delay <= 0:
            return want, reason
        self._recent.append((now, want))
        while self._recent and self._recent[0][0] <= now - delay:
            self._recent.popleft()
        held = max(d for _, d in self._recent)
        return (held, "scale-down-delay") if held > want else (want, reason)
