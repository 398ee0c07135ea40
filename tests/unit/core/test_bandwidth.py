"""TransferRate: bytes over busy time, parallel transfers sharing it, decayed by busy time, a reporting threshold."""

from __future__ import annotations

import pytest

from ember.core.bandwidth import TransferRate
from ember.testing.clock import FakeClock

MB = 1_000_000


def transfer(rate: TransferRate, clock: FakeClock, nbytes: int, seconds: float) -> None:
    rate.begin(clock.now())
    clock.advance(seconds)
    rate.end(nbytes, clock.now())


def test_one_transfer_is_its_bytes_over_its_time() -> None:
    clock, rate = FakeClock(), TransferRate(min_bytes=0)
    transfer(rate, clock, 100 * MB, 0.5)
    assert rate.rate() == pytest.approx(200 * MB)


def test_nothing_is_reported_before_min_bytes() -> None:
    clock, rate = FakeClock(), TransferRate(min_bytes=16 * MB)
    assert rate.rate() is None
    transfer(rate, clock, 8 * MB, 0.1)
    assert rate.rate() is None
    transfer(rate, clock, 8 * MB, 0.1)
    assert rate.rate() == pytest.approx(80 * MB, rel=0.01)


def test_parallel_transfers_share_their_time() -> None:
    """Four 25 MB chunks in flight together for one second: 100 MB/s in all, not 25 MB/s per connection."""
    clock, rate = FakeClock(), TransferRate(min_bytes=0)
    for _ in range(4):
        rate.begin(clock.now())
    clock.advance(1.0)
    for _ in range(4):
        rate.end(25 * MB, clock.now())
    assert rate.rate() == pytest.approx(100 * MB)


def test_idle_time_counts_for_nothing_and_keeps_the_figure() -> None:
    clock, rate = FakeClock(), TransferRate(min_bytes=0)
    transfer(rate, clock, 50 * MB, 1.0)
    clock.advance(3600)   # an hour without transfers
    assert rate.rate() == pytest.approx(50 * MB)
    transfer(rate, clock, 50 * MB, 1.0)
    assert rate.rate() == pytest.approx(50 * MB)


def test_recent_transfers_weigh_more() -> None:
    """After a slow link got faster, the figure moves towards the new speed, further the longer it lasts."""
    clock, rate = FakeClock(), TransferRate(half_life_s=10.0, min_bytes=0)
    transfer(rate, clock, 100 * MB, 10.0)             # 10 MB/s
    transfer(rate, clock, 1000 * MB, 10.0)            # 100 MB/s for one half-life
    first = rate.rate()
    assert first is not None and 10 * MB < first < 100 * MB
    transfer(rate, clock, 3000 * MB, 30.0)            # three more half-lives at 100 MB/s
    later = rate.rate()
    assert later is not None and first < later < 100 * MB
    assert later == pytest.approx(100 * MB, rel=0.1)


def test_a_failed_transfer_counts_its_time_without_bytes() -> None:
    clock, rate = FakeClock(), TransferRate(min_bytes=0)
    transfer(rate, clock, 100 * MB, 1.0)
    transfer(rate, clock, 0, 1.0)
    assert rate.rate() == pytest.approx(100 * MB / 2, rel=0.05)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="half_life_s"):
        TransferRate(half_life_s=0)
    with pytest.raises(ValueError, match="min_bytes"):
        TransferRate(min_bytes=-1)
