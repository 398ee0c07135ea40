"""The per-tenant token bucket, on a FakeClock."""

from __future__ import annotations

import pytest

from ember.core.ratelimit import Bucket, RateLimit, RateLimiter, take
from ember.testing.clock import FakeClock


def test_a_burst_passes_then_the_next_request_waits_for_one_token() -> None:
    clock, limiter = FakeClock(), RateLimiter(RateLimit(rate=2.0, burst=3))
    assert [limiter.admit("a", clock.now()).allowed for _ in range(3)] == [True] * 3
    refused = limiter.admit("a", clock.now())
    assert not refused.allowed and refused.retry_after_s == pytest.approx(0.5)
    clock.advance(0.25)
    assert limiter.admit("a", clock.now()).retry_after_s == pytest.approx(0.25)
    clock.advance(0.25)
    assert limiter.admit("a", clock.now()).allowed


def test_tenants_have_buckets_of_their_own() -> None:
    clock, limiter = FakeClock(), RateLimiter(RateLimit(rate=1.0, burst=1))
    assert limiter.admit("a", clock.now()).allowed
    assert not limiter.admit("a", clock.now()).allowed
    assert limiter.admit("b", clock.now()).allowed


def test_refill_stops_at_the_burst_and_refusals_cost_nothing() -> None:
    clock, limiter = FakeClock(), RateLimiter(RateLimit(rate=10.0, burst=2))
    limiter.admit("a", clock.now())
    clock.advance(3600)  # an hour idle refills two tokens, not 36,000
    assert [limiter.admit("a", clock.now()).allowed for _ in range(3)] == [True, True, False]
    for _ in range(50):  # retrying too early does not push the next token further out
        limiter.admit("a", clock.now())
    clock.advance(0.1)
    assert limiter.admit("a", clock.now()).allowed


def test_a_clock_that_steps_back_refills_nothing() -> None:
    verdict = take(Bucket(tokens=0.0, at=100.0), now=50.0, limit=RateLimit(rate=1.0, burst=5))
    assert not verdict.allowed and verdict.retry_after_s == pytest.approx(1.0)


@pytest.mark.parametrize(("rate", "burst", "field"), [(0, 1, "rate"), (float("inf"), 1, "rate"), (1, 0, "burst")])
def test_bad_limits_name_their_field(rate: float, burst: int, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        RateLimit(rate, burst)
