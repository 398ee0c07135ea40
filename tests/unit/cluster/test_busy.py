"""A node holds its Ray bundle while it has work (`ember.cluster.busy.BusyHold`), with a fake reservation."""

from __future__ import annotations

import asyncio

import pytest

from ember.cluster.busy import BusyHold, HoldPolicy, should_hold
from ember.testing.clock import FakeClock


class Reservation:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail = False

    def hold(self) -> None:
        if self.fail:
            raise RuntimeError("the GCS is restarting")
        self.calls.append("hold")

    def release(self) -> None:
        self.calls.append("release")


def test_should_hold_while_working_and_linger_after() -> None:
    policy = HoldPolicy(linger_s=2.0)
    assert should_hold(1, now=10.0, last_work=10.0, policy=policy)
    assert should_hold(0, now=11.9, last_work=10.0, policy=policy)
    assert not should_hold(0, now=12.0, last_work=10.0, policy=policy)
    assert not should_hold(0, now=0.0, last_work=float("-inf"), policy=policy)


def test_holds_on_work_keeps_it_through_a_short_gap_and_releases_after_the_linger() -> None:
    clock, reservation, work = FakeClock(), Reservation(), [0]
    hold = BusyHold(reservation, lambda: work[0], clock, HoldPolicy(linger_s=2.0))
    assert hold.apply(hold.wanted()) and reservation.calls == ["hold"]   # starting: busy for the linger
    clock.advance(2.0)
    assert hold.apply(hold.wanted()) and reservation.calls == ["hold", "release"]   # idle since its start
    work[0] = 3
    assert hold.apply(hold.wanted()) and hold.held and reservation.calls == ["hold", "release", "hold"]
    work[0] = 0
    clock.advance(1.5)
    assert not hold.apply(hold.wanted()) and hold.held                 # a gap shorter than the linger
    work[0] = 1
    clock.advance(1.0)
    hold.apply(hold.wanted())
    work[0] = 0
    clock.advance(1.9)
    assert not hold.apply(hold.wanted())                               # 1.9 s since the last work
    clock.advance(0.1)
    assert hold.apply(hold.wanted()) and not hold.held
    assert reservation.calls == ["hold", "release", "hold", "release"] and hold.changes == 4


def test_a_failed_hold_is_tried_again_and_a_cancelled_loop_releases() -> None:
    clock, reservation = FakeClock(), Reservation()
    hold = BusyHold(reservation, lambda: 1, clock)
    reservation.fail = True
    with pytest.raises(RuntimeError):
        hold.apply(hold.wanted())
    assert not hold.held
    reservation.fail = False

    async def run_then_cancel() -> None:
        task = asyncio.ensure_future(hold.run(0.01))
        while not hold.held:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run_then_cancel())
    assert reservation.calls == ["hold", "release"] and not hold.held
