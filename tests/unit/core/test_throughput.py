"""Completions per second over a window, and the wait a queue position means."""

from __future__ import annotations

from ember.core.throughput import ThroughputMeter, drain_s, expected_wait_s


def test_the_rate_is_unknown_until_two_requests_finished_then_counts_the_window() -> None:
    meter = ThroughputMeter(window_s=10)
    assert meter.rate(0.0) is None
    meter.completed(0.0)
    assert meter.rate(0.5) is None
    for t in (1.0, 2.0, 3.0):
        meter.completed(t)
    assert meter.rate(4.0) == 1.0
    assert meter.rate(100.0) is None   # everything left the window


def test_the_expected_wait_is_the_queue_ahead_over_the_rate_within_bounds() -> None:
    assert expected_wait_s(0, None, fallback_s=2.0) == 2.0
    assert expected_wait_s(0, 50.0, fallback_s=2.0) == 1.0          # never under a second
    assert expected_wait_s(99, 10.0, fallback_s=2.0) == 10.0
    assert expected_wait_s(10**9, 0.001, fallback_s=2.0) == 3600.0  # capped


def test_the_drain_time_is_the_waiting_over_the_rate_else_a_figure_per_request() -> None:
    assert drain_s(0, None, unmeasured_s=9.0) == 0.0
    assert drain_s(3, None, unmeasured_s=0.5) == 1.5
    assert drain_s(3, 6.0, unmeasured_s=0.5) == 0.5


def test_a_rate_is_measured_over_a_least_span() -> None:
    meter = ThroughputMeter(window_s=30)
    meter.completed(10.0)
    meter.completed(10.001)   # two completions a millisecond apart, after an idle spell
    assert meter.rate(10.001) == 2 / 1e-3 and meter.rate(10.001, min_span_s=1.0) == 2.0
