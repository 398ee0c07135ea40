"""Completions per second over a window, and the wait a queue position means."""

from __future__ import annotations

from ember.core.throughput import ThroughputMeter, expected_wait_s


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
