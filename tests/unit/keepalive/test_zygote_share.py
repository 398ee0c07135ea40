from __future__ import annotations

import numpy as np
import pytest

from ember.errors import InvalidInput
from ember.keepalive.zygote_share import MINUTE_S, WINDOW_S, ZygoteShares
from ember.sim.zygotes import Holding, held_per_minute, trailing_mean
from ember.testing.clock import FakeClock

PY = "python"


def seen(a: bool, b: bool, **more: tuple[str, bool]) -> dict[str, tuple[str, bool]]:
    """Models a and b of the python runtime, holding its zygote or not (and any others)."""
    return {"a": (PY, a), "b": (PY, b), **more}


def test_no_share_before_a_whole_minute_nor_for_a_model_not_seen() -> None:
    clock = FakeClock()
    z = ZygoteShares().observe(clock.now(), seen(True, False))
    z = z.observe(clock.advance(59.0), seen(True, False))
    assert z.share("b") is None and z.share("c") is None
    z = z.observe(clock.advance(1.0), seen(True, False))
    assert z.share("b") == 1.0 and z.share("a") == 0.0   # a alone held it: nobody else did for a
    assert z.share("c") is None


def test_the_share_is_the_time_another_model_held_it_within_each_minute() -> None:
    # a holds [0, 30), b holds [15, 60): others held it for a during b's 45 s, for b during a's 30 s.
    clock = FakeClock()
    z = ZygoteShares().observe(clock.now(), seen(True, False))
    z = z.observe(clock.advance(15.0), seen(True, True))
    z = z.observe(clock.advance(15.0), seen(False, True))
    z = z.observe(clock.advance(30.0), seen(False, True))
    assert z.share("a") == pytest.approx(45 / 60) and z.share("b") == pytest.approx(30 / 60)


def test_both_holding_each_sees_the_other_hold_it() -> None:
    clock = FakeClock()
    z = ZygoteShares().observe(clock.now(), seen(True, True))
    z = z.observe(clock.advance(120.0), seen(True, True))
    assert z.share("a") == z.share("b") == 1.0


def test_another_runtimes_zygote_does_not_count() -> None:
    clock = FakeClock()
    z = ZygoteShares().observe(clock.now(), seen(False, True, c=("node", True)))
    z = z.observe(clock.advance(60.0), seen(False, True, c=("node", True)))
    assert z.share("a") == 1.0 and z.share("b") == 0.0 and z.share("c") == 0.0


def test_the_minute_under_way_is_not_counted() -> None:
    # a holds the first minute and lets go; half a minute later b still sees one whole minute, all held.
    clock = FakeClock()
    z = ZygoteShares().observe(clock.now(), seen(True, False))
    z = z.observe(clock.advance(60.0), seen(False, False))
    z = z.observe(clock.advance(30.0), seen(False, False))
    assert z.share("b") == 1.0
    z = z.observe(clock.advance(30.0), seen(False, False))
    assert z.share("b") == pytest.approx(0.5)


def test_only_the_past_hour_counts_and_older_minutes_are_dropped() -> None:
    # a holds the first 90 minutes (seen twice only: the earlier observation holds in between), then not.
    clock = FakeClock()
    z = ZygoteShares().observe(clock.now(), seen(True, False))
    z = z.observe(clock.advance(90 * MINUTE_S), seen(False, False))
    z = z.observe(clock.advance(30 * MINUTE_S), seen(False, False))
    assert z.share("b") == pytest.approx(30 / 60)   # minutes 60 to 119: a held the first 30
    assert len(z.minutes) <= WINDOW_S / MINUTE_S + 1


def test_a_model_seen_later_counts_the_minutes_before_it() -> None:
    clock = FakeClock()
    z = ZygoteShares().observe(clock.now(), {"a": (PY, True)})
    z = z.observe(clock.advance(30 * MINUTE_S), seen(True, False))
    z = z.observe(clock.advance(30 * MINUTE_S), seen(True, False))
    assert z.share("b") == 1.0   # as in the simulator, whose minutes run from the trace's start


def test_observing_returns_a_new_value_and_a_clock_going_back_adds_no_time() -> None:
    clock = FakeClock()
    first = ZygoteShares().observe(clock.now(), seen(True, False))
    later = first.observe(clock.advance(60.0), seen(True, False))
    assert first.share("b") is None and later.share("b") == 1.0
    back = later.observe(clock.now() - 30.0, seen(False, False))
    assert back.at == later.at and back.minutes == later.minutes


def test_a_minute_longer_than_the_window_is_refused() -> None:
    with pytest.raises(InvalidInput, match="minute_s"):
        ZygoteShares(window_s=30.0)


def test_with_one_other_model_the_live_share_is_the_simulators() -> None:
    """The simulator's share (`ember.sim.batched`: per-minute holds, the past hour's whole minutes before each
    plan) from the same holds: a model holding the zygote but for two FETCH intervals, seen by another that
    never holds it (with one other model, the simulator's independence of holds is exact)."""
    fetch = [(100.0, 250.0), (1000.0, 1300.0), (4000.0, 4100.0)]
    horizon, plan_at = 6000.0, [30.0, 1500.0, 3000.0, 4050.0, 5999.0]
    sim = trailing_mean(held_per_minute(Holding(0.0, *map(np.array, zip(*fetch, strict=True))), horizon),
                        np.array(plan_at), WINDOW_S, -1.0)
    events = sorted({0.0, *[t for f in fetch for t in f], *plan_at})
    z, live = ZygoteShares(), []
    for t in events:
        z = z.observe(t, seen(not any(lo <= t < hi for lo, hi in fetch), False))
        if t in plan_at:
            live.append(z.share("b"))
    assert [-1.0 if s is None else s for s in live] == pytest.approx(sim.tolist())
