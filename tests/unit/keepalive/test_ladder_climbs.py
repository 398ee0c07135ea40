"""The ladder's plans with their climbs' lead times: a hand-computed dip, the dynamic programme against every
sequence of levels, and the policy's pre-warm moved earlier by its lead."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from ember.core.states import Rung
from ember.errors import InvalidInput
from ember.keepalive.forecast import IdleHistory
from ember.keepalive.idle_plan import COLD, HOT, LEVELS, TEMPLATE, ZYGOTE
from ember.keepalive.ladder_climbs import MIN_ALIVE, plan_climbs
from ember.keepalive.policies import LadderPolicy

LEAD_S = np.array([0.0, 0.0, 0.1, 0.3, 12.5])
STARTS, ENDS = np.array([0.0, 0.1, 0.2]), np.array([0.1, 0.2, 1.2])


def _one_row(levels: list[int], costs: list[list[float]], h: list[float], per_start: list[float]) -> list[int]:
    out = plan_climbs(np.array(levels), LEAD_S, np.array(costs)[:, :, None], np.array(h)[:, None], STARTS, ENDS,
                      np.array(per_start))
    return [int(c) for c in out[:, 0]]


@pytest.mark.parametrize(("zygote_start", "plan"), [(30.0, [HOT, ZYGOTE, HOT]), (60.0, [HOT, HOT, HOT])])
def test_a_dip_is_kept_or_filled_by_what_its_climb_costs(zygote_start: float, plan: list[int]) -> None:
    # Hot costs 10 in each cell, the zygote 15, 3, 30 (given idle at the cell's start): cell by cell, hot, the
    # zygote through the dip, hot again. Hazards 0.5, 0.1, 0.5: idle at the cells' starts with chance 1, 0.5, 0.45.
    # Weighted: hot 10, 5, 4.5; the zygote 15, 1.5, 13.5. The climb back at 0.2 s takes 0.3 s: done at 0.5 s, 0.3 of
    # the last cell's width, so S(0.5) = 0.45 x (1 - 0.5 x 0.3) = 0.3825 and 0.0675 of the starts come during it,
    # each charged the zygote's start (30 or 60) rather than hot's (0): 2.025 or 4.05.
    #   hot, zygote, hot: 10 + 1.5 + 4.5 + 2.025 = 18.025 (or 20.05); hot throughout: 19.5; hot, then the zygote:
    #   10 + 1.5 + 13.5 = 25.
    costs = [[10.0, 10.0, 10.0], [15.0, 3.0, 30.0]]
    assert _one_row([HOT, ZYGOTE], costs, [0.5, 0.1, 0.5], [0.0, 0.0, 0.0, zygote_start, 100.0]) == plan


def _total(seq: tuple[int, ...], levels: np.ndarray, costs: np.ndarray, h: np.ndarray, starts: np.ndarray,
           ends: np.ndarray, per_start: np.ndarray) -> float:
    """The module docstring's total, written out for one row and one sequence of candidate indices."""
    alive = np.concatenate([[1.0], np.cumprod(1.0 - h)])

    def survival(t: float) -> float:
        k = min(int(np.searchsorted(starts, t, side="right")) - 1, len(starts) - 1)
        share = min((t - starts[k]) / (ends[k] - starts[k]), 1.0)
        return float(alive[k] * (1.0 - h[k] * share))

    total, before = 0.0, 0
    for c, i in enumerate(seq):
        total += max(alive[c], MIN_ALIVE) * costs[i, c]
        a, b = int(levels[before]), int(levels[i])
        if c and b < a:
            t = starts[c]
            total += (per_start[a] - per_start[b]) * max(alive[c] - survival(t + LEAD_S[a] - LEAD_S[b]), 0.0)
        before = i
    return total


@pytest.mark.parametrize("seed", range(40))
def test_the_programme_finds_the_least_total_of_every_sequence(seed: int) -> None:
    rng = np.random.default_rng(seed)
    levels = np.array([HOT, TEMPLATE, ZYGOTE, COLD])
    n = 5
    starts = np.concatenate([[0.0], np.cumsum(rng.uniform(0.05, 8.0, n - 1))])
    ends = np.append(starts[1:], starts[-1] + rng.uniform(0.05, 8.0))
    h = rng.uniform(0.0, 1.0, n) * (rng.uniform(size=n) < 0.8)
    costs = rng.uniform(0.0, 50.0, (len(levels), n))
    per_start = np.sort(rng.uniform(0.0, 200.0, 5))
    got = plan_climbs(levels, LEAD_S, costs[:, :, None], h[:, None], starts, ends, per_start)[:, 0]
    best = min(_total(s, levels, costs, h, starts, ends, per_start)
               for s in itertools.product(range(len(levels)), repeat=n))
    index = tuple(int(np.flatnonzero(levels == c)[0]) for c in got)
    assert _total(index, levels, costs, h, starts, ends, per_start) == pytest.approx(best, rel=1e-12, abs=1e-12)


def test_rows_are_planned_apart() -> None:
    # Two rows in one call give what each gives alone (per-row charges per start included).
    rng = np.random.default_rng(7)
    levels = np.array([HOT, ZYGOTE, COLD])
    costs, h = rng.uniform(0, 30, (3, 3, 2)), rng.uniform(0, 1, (3, 2))
    per = np.sort(rng.uniform(0, 100, (5, 2)), axis=0)
    both = plan_climbs(levels, LEAD_S, costs, h, STARTS, ENDS, per)
    for r in range(2):
        alone = plan_climbs(levels, LEAD_S, costs[:, :, r:r + 1], h[:, r:r + 1], STARTS, ENDS, per[:, r:r + 1])
        assert (both[:, r] == alone[:, 0]).all()


def _periods(lo: float, hi: float) -> IdleHistory:
    history = IdleHistory(LadderPolicy().spec)
    for gap in np.linspace(lo, hi, 1000):
        history.observe(float(gap))
    return history


def test_a_pre_warm_begins_its_lead_earlier_where_that_pays() -> None:
    # 1,000 idle periods of 15.2 to 15.4 s, all in the head cell [15, 30 s). Cell by cell, nothing is kept before it
    # and the model comes back hot at 15 s (at latency value 1,000 and 10,000); but a climb from nothing to hot takes
    # 12.5 s, so a request at 15.3 s finds it still starting: counted with its lead, that climb costs the share of
    # the cell's arrivals in its first 12.5 s (5/6 of them, spread evenly within the cell) times 12.2 s x the latency
    # value, over 10,000 MB*s at 1,000. The zygote brought back at 1.875 s (the head cell whose start is 12.2 s or
    # more before 15 s) is up by 14.1 s, for its 150 MB x 13.1 s = 1,969 MB*s, and hot follows at 15 s from it. At
    # latency value 100 the zygote comes back at 15 s either way (its lead's starts cost ~1,000 MB*s, holding it
    # from 7.5 s 1,125).
    history = _periods(15.2, 15.4)
    for value in (1e3, 1e4):
        policy = LadderPolicy(latency_value=value)
        plain = policy.plan(history).steps
        assert plain[:2] == ((0.0, Rung.FETCH), (15.0, Rung.HOT))
        led = replace(policy, climb_lead=1.0).plan(history).steps
        assert led == ((0.0, Rung.FETCH), (1.875, Rung.ZYGOTE), *plain[1:])
    policy = LadderPolicy(latency_value=100.0)
    assert replace(policy, climb_lead=1.0).plan(history) == policy.plan(history)
    assert policy.plan(history).steps[:2] == ((0.0, Rung.FETCH), (15.0, Rung.ZYGOTE))


def test_a_climb_that_cannot_be_done_in_time_is_dropped() -> None:
    # 1,000 idle periods of 0.05 to 0.3 s. At latency value 100, cell by cell: the zygote at first (no arrival before
    # 0.05 s), hot for [0.234, 0.469 s), where most arrivals are, then the zygote again. But the climb from the
    # zygote to hot takes 0.3 s: done at 0.534 s, after the hot step has ended and after every period seen. Its
    # arrivals would start from the zygote anyway, and the hot step's memory buys nothing: with its lead counted the
    # plan holds the zygote throughout.
    history = _periods(0.05, 0.3)
    policy = LadderPolicy(latency_value=100.0)
    assert policy.plan(history).steps == ((0.0, Rung.ZYGOTE), (0.234375, Rung.HOT), (0.46875, Rung.ZYGOTE),
                                          (0.9375, Rung.FETCH))
    assert replace(policy, climb_lead=1.0).plan(history).steps == ((0.0, Rung.ZYGOTE), (0.9375, Rung.FETCH))
    # Plans that never climb (hot, then down the ladder) are left as they are.
    for value in (3e2, 1e3, 1e4, 1e5, 1e6):
        policy = LadderPolicy(latency_value=value)
        codes = [LEVELS.index(r) for _, r in policy.plan(history).steps]
        assert codes == sorted(codes)
        assert replace(policy, climb_lead=1.0).plan(history) == policy.plan(history)


def test_climb_lead_is_checked() -> None:
    with pytest.raises(InvalidInput, match="climb_lead"):
        LadderPolicy(climb_lead=-0.5)
