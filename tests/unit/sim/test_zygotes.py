"""Exact zygote accounting, checked by hand on tiny traces, and the per-minute shares the ladder prices it by."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from ember.core.rung_costs import RungCosts
from ember.keepalive.forecast import HistoryTable
from ember.keepalive.idle_plan import COLD, HOT, ZYGOTE, PlanTable
from ember.keepalive.policies import FixedKeepAlive, FixedZygote, LadderPolicy
from ember.sim.batched import evaluate_many
from ember.sim.engine import _found_up, app_items, evaluate, evaluate_held, simulate
from ember.sim.traces import AppTrace, Trace
from ember.sim.zygotes import (
    Holding,
    climbs_up,
    found_up,
    held_per_minute,
    holds_at,
    others_share,
    trailing_mean,
    union_s,
)

COSTS = RungCosts()
Z = COSTS.zygote.idle_mb


def app(name: str, *starts: float, count: int = 1, spacing: float = 0.0, duration: float = 0.0) -> AppTrace:
    t = np.array(starts)
    n = len(t)
    return AppTrace(name, t, np.full(n, count, dtype=np.int64), np.full(n, spacing), np.full(n, duration))


def test_a_runtime_zygote_is_charged_for_the_union_of_its_models_holds() -> None:
    # Fixed 10 s, no zygote floor: A holds [0, 10) and [100, 110), B [5, 15) and [50, 60); the union is
    # [0, 15) + [50, 60) + [100, 110) = 35 s (the old bound, min(trace, time on the zygote rung), charged 0).
    trace = Trace("t", "t", 200.0, [app("A", 0.0, 100.0), app("B", 5.0, 50.0)])
    r = simulate(trace, FixedKeepAlive(10.0), COSTS, runtimes=1)
    assert r.shared_mb_s == pytest.approx(35.0 * Z)
    # On two runtimes each pays its own: A 20 s, B 20 s.
    two = simulate(trace, FixedKeepAlive(10.0), COSTS, runtimes=2)
    assert two.shared_mb_s == pytest.approx(40.0 * Z)


def test_a_zygote_floor_holds_it_from_the_first_start_to_the_end() -> None:
    trace = Trace("t", "t", 200.0, [app("A", 30.0, 100.0), app("B", 5.0, 50.0)])
    r = simulate(trace, FixedZygote(10.0), COSTS, runtimes=1)
    assert r.shared_mb_s == pytest.approx(195.0 * Z)


def test_a_minute_group_releases_between_its_arrivals() -> None:
    # 3 arrivals at 0, 20, 40 s, each running 2 s, fixed 5 s: held [0, 7), [20, 27), [40, 47) = 21 s of 100.
    trace = Trace("t", "t", 100.0, [app("A", 0.0, count=3, spacing=20.0, duration=2.0)])
    items = app_items(trace.apps[0], trace.horizon_s)
    assert list(items.at) == [2.0] and list(items.every) == [20.0] and items.trailing_at == 42.0
    r = simulate(trace, FixedKeepAlive(5.0), COSTS)
    assert r.shared_mb_s == pytest.approx(21.0 * Z)


def test_an_overlapped_group_idles_from_the_latest_end() -> None:
    # Group 1 at 0 runs 30 s; group 2 (3 arrivals at 10, 20, 30, 1 s each) finds it busy until 30, then the
    # partial gap 30-30 (the third arrival comes as the first execution ends), idle from 31. Fixed 5 s:
    # held [0, 36) of 100.
    trace = Trace("t", "t", 100.0, [AppTrace("A", np.array([0.0, 10.0]), np.array([1, 3]), np.array([0.0, 10.0]),
                                             np.array([30.0, 1.0]))])
    r = simulate(trace, FixedKeepAlive(5.0), COSTS)
    assert r.shared_mb_s == pytest.approx(36.0 * Z)


def test_union_counts_overlaps_once() -> None:
    a = Holding(0.0, np.array([10.0]), np.array([50.0]))
    b = Holding(20.0, np.array([30.0, 70.0]), np.array([60.0, 100.0]))
    # A holds [0, 10) + [50, 100), B [20, 30) + [60, 70): union [0, 10) + [20, 30) + [50, 100) = 70.
    assert union_s([a, b], 100.0) == pytest.approx(70.0)
    assert union_s([a], 100.0) == pytest.approx(60.0)
    assert union_s([Holding(120.0, np.zeros(0), np.zeros(0))], 100.0) == 0.0


def test_union_from_a_later_time_cuts_every_hold_there() -> None:
    a = Holding(0.0, np.array([10.0]), np.array([50.0]))
    b = Holding(20.0, np.array([30.0, 70.0]), np.array([60.0, 100.0]))
    # From 25: A holds [50, 100), B [25, 30) + [60, 70) (its FETCH [30, 60) straddles nothing cut): 55 s.
    assert union_s([a, b], 100.0, since_s=25.0) == pytest.approx(55.0)
    # From 40 A is inside its FETCH interval [10, 50): held from 50 on; alone, 50 s.
    assert union_s([a], 100.0, since_s=40.0) == pytest.approx(50.0)
    assert union_s([a, b], 100.0, since_s=0.0) == union_s([a, b], 100.0)
    assert union_s([a, b], 100.0, since_s=100.0) == 0.0


def test_holds_at_is_the_holding_set_an_arrival_ending_fetch_included() -> None:
    b = Holding(20.0, np.array([70.0, 30.0]), np.array([100.0, 60.0]))   # any order of intervals
    at = np.array([0.0, 20.0, 29.9, 30.0, 59.0, 60.0, 65.0, 70.0, 99.0])
    assert holds_at(b, at).tolist() == [False, True, True, False, False, True, True, False, False]
    assert holds_at(Holding(5.0, np.zeros(0), np.zeros(0)), np.array([4.0, 5.0])).tolist() == [False, True]


def test_per_app_keeps_each_application_s_figures_and_hold() -> None:
    trace = Trace("t", "t", 200.0, [app("A", 0.0, 100.0), app("B", 5.0, 50.0), app("C")])
    r = simulate(trace, FixedKeepAlive(10.0), COSTS, runtimes=1, per_app=True)
    assert sorted(r.apps) == [0, 1]                               # C has no arrivals
    assert sum(run[0] for run in r.apps.values()) == pytest.approx(r.starts)
    assert sum(run[1] for run in r.apps.values()) == pytest.approx(r.idle_s)
    assert union_s([run[2] for run in r.apps.values()], 200.0) * Z == pytest.approx(r.shared_mb_s)
    assert simulate(trace, FixedKeepAlive(10.0), COSTS).apps == {}


def test_per_minute_shares_and_the_others_view() -> None:
    h = Holding(30.0, np.array([90.0]), np.array([150.0]))   # holds [30, 90) + [150, 180)
    assert held_per_minute(h, 180.0) == pytest.approx([0.5, 0.5, 0.5])
    held = np.array([[1.0, 0.0, 0.5], [0.0, 0.0, 0.5], [0.0, 0.0, 0.0]])
    others = others_share(held)
    assert others[0] == pytest.approx([0.0, 0.0, 0.5])       # only the second model is the first's "other"
    assert others[2] == pytest.approx([1.0, 0.0, 0.75])      # independence within a minute: 1 - 0.5 * 0.5
    assert trailing_mean(np.array([1.0, 0.0, 0.5]), np.array([10.0, 60.0, 150.0]), 3600.0, 0.3) == pytest.approx(
        [0.3, 1.0, 0.5])


def test_the_ladder_keeps_a_model_on_a_zygote_others_hold_anyway() -> None:
    # One busy model (every 2 s, running 2 s) holds runtime 0's zygote all day; a rare model (every ~2 h) on it.
    # Priced at the even split (150 / 2 MB) its zygote is worth dropping at a low latency value; priced at its
    # marginal cost (nothing: the busy model holds it) it never is. Either way the rare model's later starts come
    # from the zygote the busy model keeps up (the even split's from "nothing kept" found it up), at the same
    # memory: the zygote is up all day whoever holds it.
    busy = app("busy", *np.arange(0.0, 86400.0, 2.0), duration=2.0)
    rare = app("rare", *np.arange(100.0, 86400.0, 7000.0))
    trace = Trace("t", "t", 86400.0, [busy, rare])
    even = simulate(trace, LadderPolicy(latency_value=100.0, zygote_share=2, marginal_zygote=False), COSTS,
                    per_app=True)
    marginal = simulate(trace, LadderPolicy(latency_value=100.0, zygote_share=2), COSTS, per_app=True)
    assert even.apps[1][1][COLD] > 3600 and marginal.apps[1][1][COLD] == 0
    for r in (even, marginal):
        assert r.apps[1][0][COLD] == 1 and r.apps[1][0][ZYGOTE] == 12    # the compulsory first start; then 12
    assert np.array_equal(even.starts, marginal.starts)
    assert marginal.total_idle_mb_s == pytest.approx(even.total_idle_mb_s)


def test_a_start_from_nothing_finds_the_zygote_up_if_the_others_kept_it_ready() -> None:
    # B holds the zygote from 0 on; A let it go over [20, 50) and starts at 50. A full start takes 5 s, so the
    # zygote must have been up through [45, 50).
    b = Holding(0.0, np.zeros(0), np.zeros(0))
    a = Holding(10.0, np.array([20.0]), np.array([50.0]), np.array([50.0]))
    assert found_up([a, b], 5.0).tolist() == [1, 0]
    assert found_up([a], 5.0).tolist() == [0]                                      # alone on its runtime
    # B let go over [40, 48) and started again at 48: at 50 the zygote B's start made is not ready for 5 s.
    late = Holding(0.0, np.array([40.0]), np.array([48.0]), np.array([48.0]))
    assert found_up([a, late], 5.0).tolist() == [0, 0]
    assert found_up([a, late], 1.0).tolist() == [1, 0]
    # A let go only at 48: over [45, 48) A held it itself (B had let go until 47), then B: up throughout.
    a_late = Holding(10.0, np.array([48.0]), np.array([50.0]), np.array([50.0]))
    gone = Holding(0.0, np.array([40.0]), np.array([47.0]))
    assert found_up([a_late, gone], 5.0).tolist() == [1, 0]
    gone_long = Holding(0.0, np.array([40.0]), np.array([49.0]))      # B back only at 49: down over [48, 49)
    assert found_up([a_late, gone_long], 5.0).tolist() == [0, 0]
    assert found_up([a_late, gone_long], 1.0).tolist() == [1, 0]
    # Three models: neither other holds it throughout [45, 50), but together they do.
    c1 = Holding(0.0, np.array([47.0]), np.array([60.0]))            # [0, 47)
    c2 = Holding(46.0, np.zeros(0), np.zeros(0))                     # [46, ...)
    assert found_up([a, c1, c2], 5.0).tolist() == [1, 0, 0]
    assert found_up([a, c1], 5.0).tolist() == [0, 0]
    # Before the model's own first start, only the others count: B from 8 on, A starting at 20 from [12, 20).
    early = Holding(0.0, np.array([12.0]), np.array([20.0]), np.array([20.0]))
    assert found_up([early, Holding(8.0, np.zeros(0), np.zeros(0))], 12.5).tolist() == [1, 0]   # A held [7.5, 12)
    assert found_up([early, Holding(9.0, np.zeros(0), np.zeros(0))], 12.5).tolist() == [1, 0]
    assert found_up([Holding(9.0, np.array([12.0]), np.array([20.0]), np.array([20.0])),
                     Holding(8.5, np.zeros(0), np.zeros(0))], 12.5).tolist() == [0, 0]   # [7.5, 8.5): nobody
    # A start at the very step its plan drops to "nothing" (no FETCH interval): B holds throughout.
    instant = Holding(10.0, np.zeros(0), np.zeros(0), np.array([30.0]))
    assert found_up([instant, b], 5.0).tolist() == [1, 0]


def test_a_zygote_another_model_started_just_before_is_not_ready() -> None:
    # Own drops to nothing 2 s after each arrival (0, 10, 20, 30); it starts from nothing at 10 and 20.
    own = Holding(0.0, np.array([2.0, 12.0, 25.0, 32.0]), np.array([10.0, 20.0, 28.0, 40.0]), np.array([10.0, 20.0]))
    other = Holding(5.0, np.array([15.0]), np.array([25.0]))        # holds [5, 15) and from 25 on
    assert found_up([own, other], 0.0).tolist() == [1, 0]          # at 10 (not at 20: the other let go at 15)
    assert found_up([own, other], 4.0).tolist() == [1, 0]          # up through [6, 10)
    assert found_up([own, other], 6.0).tolist() == [0, 0]          # not through [4, 10): the other began at 5
    same = Holding(10.0, np.zeros(0), np.zeros(0))                  # a start at the same moment
    assert found_up([own, same], 0.0).tolist() == [1, 0]           # at 20 only
    just = Holding(9.8, np.array([19.7]), np.array([19.9]))        # begins at 9.8; lets go at 19.7, back at 19.9
    assert found_up([own, just], 0.5).tolist() == [0, 0]
    assert found_up([own, just], 0.1).tolist() == [2, 0]


def test_the_engine_counts_a_start_from_nothing_that_found_the_zygote_up_as_a_zygote_start() -> None:
    # Fixed 10 s: A arrives at 0, 5, 30 and 100, so it starts from nothing at 30 and 100 (FETCH over [15, 30) and
    # [40, 100)); B, every 2 s and running 2 s, holds the zygote from 1 s on.
    a = app("A", 0.0, 5.0, 30.0, 100.0)
    b = app("B", *np.arange(1.0, 200.0, 2.0), duration=2.0)
    alone = simulate(Trace("t", "t", 200.0, [a]), FixedKeepAlive(10.0), COSTS, per_app=True)
    assert alone.apps[0][2].fetch_starts.tolist() == [30.0, 100.0]
    assert alone.apps[0][2].fetch_lo.tolist() == [15.0, 40.0, 110.0]
    assert alone.starts[COLD] == 3 and alone.starts[ZYGOTE] == 0
    shared = simulate(Trace("t", "t", 200.0, [a, b]), FixedKeepAlive(10.0), COSTS, runtimes=1, per_app=True)
    assert shared.apps[0][0][COLD] == 1 and shared.apps[0][0][ZYGOTE] == 2        # only the first is a full start
    assert shared.apps[0][2].fetch_lo.tolist() == [15.0, 40.0, 110.0]              # what it holds is unchanged
    apart = simulate(Trace("t", "t", 200.0, [a, b]), FixedKeepAlive(10.0), COSTS, runtimes=2, per_app=True)
    assert apart.apps[0][0][COLD] == 3                                              # B's zygote is another runtime's
    # A zygote the others hold must be ready: with a full start of 200 s, none is.
    late = simulate(Trace("t", "t", 200.0, [a, b]), FixedKeepAlive(10.0), COSTS, runtimes=1, ready_s=200.0)
    assert late.starts[COLD] == 4                                                   # and B's first


@dataclass(frozen=True)
class Prewarm(FixedKeepAlive):
    """Hot for 5 s, then nothing, then the zygote again from 60 s (a pre-warm), whatever the history."""

    def plans(self, table: HistoryTable, need_s: np.ndarray | None = None) -> PlanTable:
        return PlanTable.constant(table.rows, [(0.0, HOT), (5.0, COLD), (60.0, ZYGOTE)])


def test_a_start_mid_climb_from_nothing_finds_the_zygote_another_model_kept_up() -> None:
    # A arrives at 0 and 65: its plan climbed back to the zygote at 60, which takes 12.2 s from nothing, so the
    # start at 65 is one from nothing; B, busy throughout, keeps the runtime's zygote up, so it is a zygote start.
    a = app("A", 0.0, 65.0)
    b = app("B", *np.arange(0.0, 200.0, 2.0), duration=2.0)
    alone = simulate(Trace("t", "t", 200.0, [a]), Prewarm(), COSTS, per_app=True)
    assert alone.apps[0][0][COLD] == 2 and alone.apps[0][2].fetch_starts.tolist() == [65.0]
    shared = simulate(Trace("t", "t", 200.0, [a, b]), Prewarm(), COSTS, per_app=True)
    assert shared.apps[0][0][COLD] == 1 and shared.apps[0][0][ZYGOTE] == 1
    instant = simulate(Trace("t", "t", 200.0, [a]), Prewarm(), COSTS, per_app=True, ready_s=0.0)
    assert instant.apps[0][0][COLD] == 2                        # alone: no other model's zygote to find
    # Climbs taking no time: from the zygote (the plan's step at 65 s).
    it = app_items(a, 200.0)
    plans = PlanTable.constant(max(1, it.n_segs), [(0.0, HOT), (5.0, COLD), (60.0, ZYGOTE)])
    assert evaluate(plans, it)[0].tolist() == [0, 0, 0, 1, 1]


@dataclass(frozen=True)
class PrewarmHot(FixedKeepAlive):
    """Hot for 5 s, then nothing, then hot again from 60 s (a pre-warm from nothing), whatever the history."""

    def plans(self, table: HistoryTable, need_s: np.ndarray | None = None) -> PlanTable:
        return PlanTable.constant(table.rows, [(0.0, HOT), (5.0, COLD), (60.0, HOT)])


def test_a_climb_back_from_nothing_while_the_zygote_is_up_forks_the_model_from_it() -> None:
    # A arrives at 0, 61 and 121.1: two periods ending 1 s and 0.1 s into its climb from nothing to hot at 60 s
    # (12.5 s alone: two starts from nothing). B, busy throughout, keeps the runtime's zygote up: the climb forks A
    # from it and is done at 60.2997, so the first is hot and the second a zygote start.
    a = app("A", 0.0, 61.0, 121.1)
    b = app("B", *np.arange(0.0, 300.0, 2.0), duration=2.0)
    alone = simulate(Trace("t", "t", 300.0, [a]), PrewarmHot(), COSTS, per_app=True)
    assert alone.apps[0][0].tolist() == [0, 0, 0, 0, 3]
    shared = simulate(Trace("t", "t", 300.0, [a, b]), PrewarmHot(), COSTS, per_app=True)
    assert shared.apps[0][0].tolist() == [1, 0, 0, 1, 1]
    hold = shared.apps[0][2]
    # Only the start the climb makes warmer than a zygote start is kept (the other is one by `found_up` either way).
    assert hold.climb_at.tolist() == [61.0] and hold.climb_since.tolist() == [60.0]
    assert climbs_up([hold, shared.apps[1][2]], COSTS.cold.start_s, 5).tolist() == [[1, 0, 0, 0, 0], [0] * 5]
    # B only from 50 s: its zygote, made then, is not ready at 60 (nor at 61), so A's first climb is a full start's;
    # by 121 it has been up long enough.
    late = simulate(Trace("t", "t", 300.0, [a, app("B", *np.arange(50.0, 300.0, 2.0), duration=2.0)]), PrewarmHot(),
                    COSTS, per_app=True)
    assert late.apps[0][0].tolist() == [0, 0, 0, 1, 2]


def test_fetch_starts_of_a_repeated_item_are_its_periods_ends() -> None:
    # A minute group of 3 arrivals 20 s apart, each running 1 s, under a 10 s keep-alive: two gaps of 19 s, each
    # ending a FETCH interval [11, 20) after its arrival; the next group 100 s later.
    a = app("A", 0.0, 100.0, count=3, spacing=20.0, duration=1.0)
    r = simulate(Trace("t", "t", 300.0, [a]), FixedKeepAlive(10.0), COSTS, per_app=True)
    hold = r.apps[0][2]
    assert hold.fetch_starts.tolist() == [20.0, 40.0, 100.0, 120.0, 140.0]
    assert np.isin(hold.fetch_starts, hold.fetch_hi).all() and r.starts[COLD] == 6


def test_a_model_s_own_fetch_intervals_overlapping_by_a_rounding_do_not_open_a_gap_in_the_others_hold() -> None:
    # Executions of no length, nothing kept from the end of each: A's second FETCH interval begins at
    # 64.392 + (949.975 - 64.392), one float step before its first ends (949.975). B holds the zygote throughout.
    a = app("A", 64.392, 949.975, 2653.565)
    it = app_items(a, 3100.0)
    hold = evaluate_held(PlanTable.constant(max(1, it.n_segs), [(0.0, COLD)]), it, COSTS.start_s())[3]
    assert hold.fetch_lo[1] < hold.fetch_hi[0]                   # the rounding the sweep must survive
    b = Holding(-1.0, np.zeros(0), np.zeros(0))
    assert found_up([hold, b], 12.5).tolist() == [2, 0]
    assert union_s([hold, b], 3100.0) == pytest.approx(3101.0)


def _random_plans(rng: np.random.Generator, rows: int, gaps: np.ndarray) -> PlanTable:
    """Up to 6 steps per row on random levels (drops and climbs, from nothing too), half of them less than a full
    start before some idle period's end (so that periods end mid-climb)."""
    width = int(rng.integers(2, 7))
    breaks, codes = np.full((rows, width), np.inf), np.full((rows, width), COLD, dtype=np.int8)
    gaps = gaps[gaps > 13.0] if (gaps > 13.0).any() else np.array([300.0])
    for r in range(rows):
        n = int(rng.integers(1, width))
        near = rng.choice(gaps, n) - rng.uniform(0.0, 12.5, n)
        at = np.concatenate([[0.0], np.sort(np.where(rng.random(n) < 0.5, near, rng.uniform(0.0, 300.0, n)))])
        breaks[r, :len(at)] = at
        codes[r, :len(at)] = rng.choice(5, len(at), p=[0.3, 0.05, 0.05, 0.2, 0.4])
    return PlanTable(breaks, codes)


@pytest.mark.parametrize("seed", range(8))
def test_random_plans_on_shared_runtimes_keep_the_start_counts_whole(seed: int) -> None:
    """Random plans with climbs, minute groups and executions on 1 or 2 runtimes: the batched evaluation gives
    every hold's floats; after the zygote and climb rules no count is negative, every invocation is counted once,
    and a climb only ever moves a start `found_up` made a zygote start."""
    rng = np.random.default_rng(seed)
    apps = [app(f"a{k}", *np.sort(rng.uniform(0.0, 2000.0, int(rng.integers(2, 30)))).tolist(),
                count=int(rng.integers(1, 4)), spacing=float(rng.choice([1.0, 20.0])),
                duration=float(rng.choice([0.0, 0.5, 5.0]))) for k in range(int(rng.integers(3, 7)))]
    items = [app_items(a_, 2100.0) for a_ in apps]
    rows = [max(1, it.n_segs) for it in items]
    plans = [_random_plans(rng, r, it.gaps) for r, it in zip(rows, items, strict=True)]
    start_s = COSTS.start_s()
    runs = [(s, i, h) for s, i, _, h in (evaluate_held(p, it, start_s) for p, it in zip(plans, items, strict=True))]
    cuts = np.concatenate([[0], np.cumsum(rows)])
    table = PlanTable.merge(int(cuts[-1]), [(np.arange(cuts[i], cuts[i + 1]), p) for i, p in enumerate(plans)])
    for (s, i, h), (s2, i2, h2) in zip(runs, evaluate_many(table, items, rows, start_s), strict=True):
        assert np.array_equal(s, s2) and np.array_equal(i, i2)
        for name in ("fetch_lo", "fetch_hi", "fetch_starts", "climb_at", "climb_since", "climb_up"):
            assert np.array_equal(getattr(h, name), getattr(h2, name)), name
        assert np.isin(h.climb_at, h.fetch_starts).all()
    runtime_of = rng.integers(0, 2, len(items))
    for ready_s in (12.5, 3.0, 0.0):
        out = _found_up(runs, runtime_of, ready_s)
        for (before, _, _), (after, _, _), it in zip(runs, out, items, strict=True):
            assert (after >= 0).all() and after.sum() == before.sum() == it.invocations
        for r in np.unique(runtime_of):
            holds = [runs[i][2] for i in np.flatnonzero(runtime_of == r)]
            assert (climbs_up(holds, ready_s, 5).sum(axis=1) <= found_up(holds, ready_s)).all()
