"""When an idle vLLM engine's first step waits for the rest of a burst of streams (ember.runtimes.vllm.gathering)."""

from __future__ import annotations

from ember.runtimes.vllm import JOIN_MAX_S, JOIN_QUIET_S, gathering


def test_a_lone_request_waits_for_nothing() -> None:
    assert not gathering([], 0.0)
    assert not gathering([10.0], 10.0)


def test_a_burst_waits_until_it_is_quiet() -> None:
    joins = [10.0, 10.002]
    assert gathering(joins, 10.002)
    assert gathering(joins, 10.002 + JOIN_QUIET_S / 2)
    assert not gathering(joins, 10.002 + JOIN_QUIET_S)


def test_a_burst_that_keeps_arriving_waits_at_most_the_cap() -> None:
    step = JOIN_QUIET_S / 2
    joins = [10.0 + i * step for i in range(100)]
    now = 10.0 + JOIN_MAX_S
    assert not gathering([j for j in joins if j <= now], now)
    assert gathering([j for j in joins if j <= now - step], now - step)
