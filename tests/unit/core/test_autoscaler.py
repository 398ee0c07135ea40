"""The KPA autoscaler, step by step with a fake clock."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ember.core.autoscaler import Autoscaler, AutoscalerConfig
from ember.errors import InvalidInput
from ember.testing.clock import FakeClock
from ember.wire.contract import parse_contract


@dataclass(frozen=True)
class Step:
    """Record `load` once a second for `secs` seconds, then decide with `ready` instances."""

    secs: int
    load: float | None
    ready: int
    desired: int
    panic: bool = False
    reason: str | None = None


def run(config: AutoscalerConfig, steps: list[Step]) -> None:
    clock = FakeClock(1000.0)
    scaler = Autoscaler(config, created_at=clock.now())
    for i, step in enumerate(steps):
        for _ in range(step.secs):
            clock.advance(1.0)
            if step.load is not None:
                scaler.record(clock.now(), step.load)
        got = scaler.decide(clock.now(), step.ready)
        where = f"step {i} ({step})"
        assert got.desired == step.desired, f"{where}: desired {got.desired} ({got.reason})"
        assert got.panic == step.panic, f"{where}: panic {got.panic}"
        if step.reason is not None:
            assert got.reason == step.reason, where


ONE = AutoscalerConfig(target_concurrency=1, target_utilization_pct=100)

SCENARIOS = {
    "steady load": (ONE, [
        Step(60, 3.0, 3, 3),
        Step(30, 3.0, 3, 3),
        Step(60, 3.0, 3, 3, reason="stable"),
    ]),
    "utilization headroom (Knative default 70%)": (AutoscalerConfig(target_concurrency=1), [
        Step(60, 7.0, 10, 10),
    ]),
    "burst into panic and out": (ONE, [
        Step(60, 2.0, 2, 2),
        Step(6, 10.0, 2, 10, panic=True),           # panic window average 10 >= 2 x 2 ready
        Step(10, 1.0, 10, 10, panic=True),          # never scales down in panic
        Step(40, 1.0, 10, 10, panic=True),          # still within a stable window of the last trigger
        Step(20, 1.0, 10, 5, panic=False),          # a full window calm: stable desire, at most halving
        Step(60, 1.0, 5, 2),
        Step(60, 1.0, 2, 1),
    ]),
    "panic grows but never shrinks": (ONE, [
        Step(60, 1.0, 1, 1),
        Step(3, 8.0, 1, 5, panic=True),             # panic window: (3 x 1 + 3 x 8) / 6 = 4.5
        Step(6, 1.0, 5, 5, panic=True),             # the panic desire drops to 1, the scale holds
    ]),
    # Knative's defaults (target 100 at 70%: 70 per pod), one pod, a burst from 10 to 120 concurrent requests.
    # After 4 s the 6 s panic window averages (2 x 10 + 4 x 120) / 6 = 83.3: ceil(83.3 / 70) = 2 pods per ready
    # pod >= 2, so Knative panics (the raw ratio, 1.19, never reaches 2 at a steady 120); the stable desire
    # (60 s average 17.3: 1 pod) is smaller, the panic desire wins.
    "a one-pod burst panics on the rounded-up panic desire": (AutoscalerConfig(target_concurrency=100), [
        Step(60, 10.0, 1, 1),
        Step(3, 120.0, 1, 1, panic=False),          # (3 x 10 + 3 x 120) / 6 = 65: ceil(0.93) = 1
        Step(1, 120.0, 1, 2, panic=True),
    ]),
    "scale to zero and back": (ONE, [
        Step(60, 1.0, 1, 1),
        Step(59, 0.0, 1, 1),                        # the stable window still holds a sample
        Step(1, 0.0, 1, 1, reason="grace"),         # desire 0, but the grace period runs
        Step(29, 0.0, 1, 1, reason="grace"),
        Step(1, 0.0, 1, 0),                         # 30 s of zero desire: scale to zero
        Step(60, 0.0, 0, 0),
        Step(1, 2.0, 0, 1),                         # traffic again at zero: at least one at once
    ]),
    "scale-down rate": (AutoscalerConfig(target_concurrency=1, target_utilization_pct=100,
                                         enable_scale_to_zero=False, initial_scale=1), [
        Step(60, 8.0, 8, 8),
        Step(120, 0.0, 8, 4),                        # at most halve per decision (rate 2)
    ]),
    "scale-up rate": (AutoscalerConfig(target_concurrency=1, target_utilization_pct=100, max_scale_up_rate=2), [
        Step(60, 8.0, 1, 2, panic=True),            # at most 2 x ready per decision
        Step(1, 8.0, 2, 4, panic=True),
    ]),
    "scale-down delay": (AutoscalerConfig(target_concurrency=1, target_utilization_pct=100,
                                          scale_down_delay_s=30), [
        Step(60, 4.0, 4, 4),
        Step(20, 1.0, 4, 4, reason="scale-down-delay"),   # desire 3, but 4 was wanted 20 s ago
        Step(20, 1.0, 4, 3, reason="scale-down-delay"),   # desire 2, 3 was wanted 20 s ago
        Step(31, 1.0, 4, 2),
    ]),
    "bounds": (AutoscalerConfig(target_concurrency=1, target_utilization_pct=100, min_scale=2, max_scale=5), [
        Step(60, 0.0, 2, 2),
        Step(60, 50.0, 2, 5, panic=True),
    ]),
    "initial scale holds until reached": (AutoscalerConfig(target_concurrency=1, target_utilization_pct=100,
                                                           initial_scale=3), [
        Step(60, 0.0, 0, 3, reason="initial"),
        Step(1, 0.0, 3, 1),                         # reached: now free to shrink (at most halving)
        Step(1, 0.0, 1, 1, reason="grace"),
    ]),
    "restart keeps the current scale without data": (ONE, [
        Step(5, None, 3, 3, reason="no-data"),
        Step(60, 5.0, 3, 5),
    ]),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(name: str) -> None:
    config, steps = SCENARIOS[name]
    run(config, steps)


def test_request_at_zero_is_immediate() -> None:
    clock = FakeClock()
    scaler = Autoscaler(AutoscalerConfig(target_concurrency=1, initial_scale=0))
    for _ in range(120):
        clock.advance(1)
        scaler.record(clock.now(), 0.0)
    assert scaler.decide(clock.now(), 0).desired == 0
    hit = scaler.activate(clock.now())
    assert hit.desired >= 1 and hit.reason == "activation"
    clock.advance(1)
    scaler.record(clock.now(), 1.0)
    assert scaler.decide(clock.now(), 0).desired >= 1


def test_restart_loses_panic_but_keeps_scale() -> None:
    clock = FakeClock()
    first = Autoscaler(ONE, created_at=clock.now())
    for _ in range(60):
        clock.advance(1)
        first.record(clock.now(), 12.0)
    assert first.decide(clock.now(), 2).panic
    restarted = Autoscaler(ONE, created_at=clock.now())
    clock.advance(1)
    assert restarted.decide(clock.now(), 12).desired == 12


def test_short_history_averages_what_it_has() -> None:
    scaler = Autoscaler(ONE)
    scaler.record(10.0, 4.0)
    scaler.record(11.0, 4.0)
    d = scaler.decide(11.0, 4)
    assert d.stable_concurrency == pytest.approx(4.0)
    assert d.desired == 4


def test_knative_defaults() -> None:
    c = AutoscalerConfig()
    assert (c.stable_window_s, c.panic_window_pct, c.panic_threshold_pct) == (60, 10, 200)
    assert (c.max_scale_up_rate, c.max_scale_down_rate, c.scale_down_delay_s) == (1000, 2, 0)
    assert c.scale_to_zero_grace_s == 30 and c.panic_window_s == 6


def test_from_contract_takes_scaling_section() -> None:
    contract = parse_contract({
        "name": "m", "runtime": "python", "entrypoint": "a:B",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
        "scaling": {"min_scale": 1, "max_scale": 3, "initial_scale": 2, "target_concurrency": 4},
    })
    c = AutoscalerConfig.from_contract(contract, stable_window_s=30)
    assert (c.min_scale, c.max_scale, c.initial_scale, c.target_concurrency) == (1, 3, 2, 4)
    assert c.stable_window_s == 30 and c.max_scale_down_rate == 2


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"stable_window_s": 1}, "stable_window_s"),
        ({"panic_threshold_pct": 50}, "panic_threshold_pct"),
        ({"max_scale_down_rate": 1}, "max_scale_down_rate"),
        ({"target_concurrency": 0}, "target_concurrency"),
        ({"min_scale": 5, "max_scale": 2}, "min_scale"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_knobs_name_the_field(data: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidInput, match=field):
        AutoscalerConfig.parse(data)


def test_bad_sample_is_rejected() -> None:
    scaler = Autoscaler(ONE)
    with pytest.raises(InvalidInput, match="concurrency"):
        scaler.record(1.0, -1.0)
    scaler.record(5.0, 1.0)
    with pytest.raises(InvalidInput, match="older"):
        scaler.record(3.0, 1.0)
