"""Keep-alive policies: hand-computed hybrid windows, the ladder's choices, and one implementation for two drivers."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ember.core.rung_costs import RungCost, RungCosts
from ember.core.rung_plan import IdlePlan
from ember.core.states import Rung
from ember.errors import InvalidInput
from ember.keepalive.forecast import HistogramSpec, HistoryTable, IdleHistory, arima_forecast
from ember.keepalive.idle_plan import COLD, HOT, ZYGOTE, PlanTable, start_rung
from ember.keepalive.policies import FixedKeepAlive, HybridHistogram, LadderCold, LadderPolicy, make_policy

H, F, Z = Rung.HOT, Rung.FETCH, Rung.ZYGOTE


def history(idle_times: list[float], policy: HybridHistogram | LadderPolicy | None = None) -> IdleHistory:
    h = (policy or HybridHistogram()).new_history()
    for t in idle_times:
        h.observe(t)
    return h


def test_fixed_keeps_hot_for_ten_minutes() -> None:
    plan = FixedKeepAlive().plan(IdleHistory())
    assert plan.steps == ((0.0, H), (600.0, F))
    assert plan.rung_at(599.9) == H and plan.rung_at(600.0) == F
    assert (plan.prewarm_s, plan.keepalive_s) == (0.0, 600.0)


@pytest.mark.parametrize(
    ("idle_times", "steps"),
    [
        # No history: the conservative default, hot for the whole 4-hour range.
        ([], ((0.0, H), (14400.0, F))),
        # All in bin 10 (10-11 min): pre-warm at 10 min - 10% = 540 s, unload at 11 min + 10% = 726 s.
        ([630.0] * 20, ((0.0, F), (540.0, H), (726.0, F))),
        # 99 in bin 2 and 1 in bin 30: head bin 2 -> 108 s; the 99th percentile is reached in bin 2 -> 198 s.
        ([150.0] * 99 + [1830.0], ((0.0, F), (108.0, H), (198.0, F))),
        # Head in bin 0: no pre-warm, kept from the end; tail bin 4 -> unload at 5 min + 10% = 330 s.
        ([10.0] * 50 + [250.0] * 50, ((0.0, H), (330.0, F))),
        # One idle time in every bin: CV 0 < 2, not representative: conservative.
        ([60.0 * b + 1 for b in range(240)], ((0.0, H), (14400.0, F))),
        # Mostly out of range (5 h each): ARIMA forecasts 18000 s; pre-warm at -15%, unload at +15%.
        ([18000.0] * 6, ((0.0, F), (15300.0, H), (20700.0, F))),
    ],
)
def test_hybrid_windows_by_hand(idle_times: list[float], steps: tuple[tuple[float, Rung], ...]) -> None:
    plan = HybridHistogram().plan(history(idle_times))
    assert len(plan.steps) == len(steps)
    for (got_s, got_r), (want_s, want_r) in zip(plan.steps, steps, strict=True):
        assert got_r == want_r
        assert got_s == pytest.approx(want_s)


@pytest.mark.parametrize(("bins_filled", "representative"), [(48, True), (49, False)])
def test_hybrid_cv_threshold_boundary(bins_filled: int, representative: bool) -> None:
    # k equally filled bins of 240 have CV sqrt(240 (240 - k) / (239 k)): 2.004 for 48, 1.978 for 49.
    idle = [60.0 * b + 5 for b in range(bins_filled)] * 3
    h = history(idle)
    cv = float(h.table().cv()[0])
    assert cv == pytest.approx(np.std(h.table().dense(), ddof=1) / np.mean(h.table().dense()))
    assert (cv >= 2.0) == representative
    plan = HybridHistogram().plan(h)
    conservative = ((0.0, H), (14400.0, F))
    assert (plan.steps != conservative) == representative


def test_hybrid_range_is_the_knob() -> None:
    policy = HybridHistogram().with_knob(3600.0)
    assert policy.range_s == 3600.0 and policy.spec.n_bins == 60
    assert policy.plan(IdleHistory(policy.spec)).steps == ((0.0, H), (3600.0, F))
    # 2-hour idle times are out of range for a 1-hour histogram: the forecast takes over.
    plan = policy.plan(history([7200.0] * 4, policy))
    assert plan.prewarm_s == pytest.approx(7200 * 0.85)


def test_arima_on_exact_series() -> None:
    x = [10.0]
    for _ in range(30):
        x.append(0.8 * x[-1] + 2.0)
    assert arima_forecast(np.array(x)) == pytest.approx(0.8 * x[-1] + 2.0, rel=1e-6)
    trend = np.arange(20) * 5.0 + 100.0
    assert arima_forecast(trend) == pytest.approx(200.0, rel=1e-6)
    assert arima_forecast(np.array([42.0])) == 42.0
    with pytest.raises(InvalidInput):
        arima_forecast(np.array([]))


def ladder(**kw: object) -> LadderPolicy:
    return LadderPolicy(**{"zygote_share": 100.0, **kw})  # type: ignore[arg-type]


def test_ladder_busy_model_stays_hot_rare_model_sits_on_the_zygote() -> None:
    busy = ladder().plan(history([5.0] * 200))
    assert busy.rung_at(0) == H and busy.rung_at(30) == H
    rare = ladder().plan(history([36000.0] * 10))
    assert rare.rung_at(0) == Z and rare.rung_at(1e6) == Z


def test_ladder_plan_of_one_history_at_the_share_others_hold_the_zygote() -> None:
    policy, h = LadderPolicy(), history([36000.0] * 10)
    even, free = policy.plan(h), policy.plan(h, zygote_others=1.0)
    assert policy.plan(h, zygote_others=None) == even
    assert even.rung_at(1e6) == F and free.rung_at(1e6) == Z   # the whole zygote for it alone, or nothing more
    assert free == policy.plans(h.table(), zygote_others=np.array([1.0])).row(0)
    assert PlanTable.of(even).row(0) == even
    # A cheaper zygote can change a plan with FETCH only; a dearer one any plan.
    assert policy.to_replan(PlanTable.of(even), None, np.array([1.0])).tolist() == [0]
    assert policy.to_replan(PlanTable.of(free), np.array([1.0]), np.array([1.0])).tolist() == []
    assert policy.to_replan(PlanTable.of(free), np.array([1.0]), None).tolist() == [0]
    # Free as the zygote is, a store-backed model's own copy of its weights in the memory tier is not: a large one
    # is let go (FETCH releases it), a small one kept with the zygote.
    dear, cheap = (replace(policy, costs=replace(policy.costs, memory_copy_mb=mb)) for mb in (4096.0, 1.0))
    assert dear.plan(h, zygote_others=1.0).rung_at(1e6) == F and cheap.plan(h, zygote_others=1.0).rung_at(1e6) == Z


def test_ladder_prewarms_before_a_periodic_arrival() -> None:
    plan = ladder(latency_value=1e6).plan(history([1830.0] * 100))   # every ~30.5 minutes
    assert plan.rung_at(60) == Z            # nothing expected for half an hour: the shared zygote
    assert plan.rung_at(1830) == H          # hot around the expected arrival


def test_ladder_latency_value_spans_nothing_to_hot() -> None:
    h = history([600.0] * 20 + [3000.0] * 20)
    assert {r for _, r in ladder(latency_value=0.0).plan(h).steps} == {F}
    assert {r for _, r in ladder(latency_value=1e15).plan(h).steps} == {H}


def test_ladder_uses_only_allowed_rungs() -> None:
    plan = ladder(rungs=(H, F), latency_value=1e5).plan(history([36000.0] * 10))
    assert {r for _, r in plan.steps} <= {H, F}
    with pytest.raises(InvalidInput, match="fetch"):
        ladder(rungs=(H, Z))


def test_ladder_uses_cheaper_measured_rungs() -> None:
    # If the benchmark finds a template much smaller than an instance, idle minutes move onto it.
    costs = RungCosts(template=RungCost(40.0, 0.085))
    plan = ladder(costs=costs, latency_value=3e4).plan(history([900.0] * 50))
    assert Rung.TEMPLATE in {r for _, r in plan.steps}


# 50 idle periods of 0.1 s, 5 of 0.3 s and 5 of 1 s: the head cells [0, 0.234), [0.234, 0.469), [0.469, 0.9375)
# and [0.9375, 1.875) hold 50, 5, 0 and 5 of them. A vanishing prior keeps the figures hand-computable.
BURSTS = [0.1] * 50 + [0.3] * 5 + [1.0] * 5


def test_ladder_head_cells_by_hand() -> None:
    plain = LadderPolicy(prior_weight=1e-6, smooth_weight=0.0, latency_value=1e4)
    assert plain.cell_starts()[:10] == pytest.approx([0, 0.234375, 0.46875, 0.9375, 1.875, 3.75, 7.5, 15, 30, 60])
    table = history(BURSTS, plain).table()
    # Expected seconds held per cell given idle at its start: E[min(idle, end) - start | idle >= start].
    held = [(50 * 0.1 + 10 * 0.234375) / 60, (5 * (0.3 - 0.234375) + 5 * 0.234375) / 10, 0.46875, 1.0 - 0.9375]
    np.testing.assert_allclose(plain.held_head(table)[0, :4], held, rtol=1e-5)
    np.testing.assert_allclose(plain.hazards(table)[0, :4], [50 / 60, 5 / 10, 0.0, 5 / 5], atol=1e-6)
    # Cell [0.469, 0.9375) saw no arrival, so "nothing kept" looks free there: a hole the next burst may hit.
    steps = plain.plan(history(BURSTS, plain)).steps
    assert steps[:3] == ((0.0, H), (0.46875, F), (0.9375, H))


def test_ladder_cold_value_by_hand() -> None:
    """The cold-start objective on BURSTS (zygote_share 1: hot 250 + 150 MB with its zygote, zygote 150, nothing 0).

    Per cell (hazard h, expected seconds held s): hot 400 s, zygote 150 s + h c, nothing h c; a zygote start is as
    cold as a fetch, so the zygote never wins without a latency value. Cell 0 [0, 0.234): h 5/6, s 0.1224: hot
    48.96 MB*s against nothing 0.833 c, hot from c 58.75. Cell 1: h 1/2, s 0.15: hot 60 against c / 2, hot from
    c 120. Cell 2: h 0: nothing. Cell 3 [0.9375, 1.875): h 1, s 0.0625: hot 25 against c, hot from c 25."""
    def plan(c: float, **kw: float) -> IdlePlan:
        p = LadderCold(prior_weight=1e-6, smooth_weight=0.0, cold_value=c, cold_per_app=False, **kw)
        return p.plan(history(BURSTS, p))

    at = (0.1, 0.3, 0.6, 1.0)
    assert [plan(24.0).rung_at(t) for t in at] == [F, F, F, F]
    assert [plan(26.0).rung_at(t) for t in at] == [F, F, F, H]
    assert [plan(59.0).rung_at(t) for t in at] == [H, F, F, H]
    assert [plan(121.0).rung_at(t) for t in at] == [H, H, F, H]
    # A mix: at latency value 100, cell 0 costs hot 48.96 + 100 x 0.0003 x 5/6 = 48.985, zygote 18.36 + 100 x 0.3 x
    # 5/6 = 43.36, nothing 1041.7: the zygote. 10 MB*s more per cold start (8.33 at h 5/6) makes hot the cheaper.
    assert plan(0.0, latency_value=100.0).rung_at(0.1) == Z
    assert plan(10.0, latency_value=100.0).rung_at(0.1) == H
    assert LadderCold().knob == "cold_value" and LadderCold().with_knob(7.0).cold_value == 7.0


def test_ladder_cold_value_per_app_by_hand() -> None:
    """Per app (`LadderCold`'s default), a cold start costs cold_value x the share of a day's invocations one start
    is: BURSTS' mean idle time, 11.5 s over 60 periods, 0.19167 s, a share of 2.2184e-6 (the prior's mean does not
    enter once a period is seen, whatever its weight). So cell 3 (hot 25 MB*s against nothing 1 x c x share) turns
    hot from c = 25 / 2.2184e-6 = 1.1270e7."""
    for weight in (1e-6, 2.0):
        p = LadderCold(prior_weight=weight, smooth_weight=0.0)
        assert p.day_share(history(BURSTS, p).table())[0] == pytest.approx(11.5 / 60 / 86400, rel=1e-9)
    p = LadderCold(prior_weight=1e-6, smooth_weight=0.0)
    assert p.with_knob(1.1266e7).plan(history(BURSTS, p)).rung_at(1.0) == F     # (the old estimate: hot here)
    assert p.with_knob(1.1274e7).plan(history(BURSTS, p)).rung_at(1.0) == H
    # A model never seen idle: the log-uniform prior's mean (0.1 s to a day: 6,321 s), 7.3% of a day per start.
    assert p.day_share(p.new_history().table())[0] == pytest.approx((86400 - 0.1) / np.log(864000) / 86400)


def test_ladder_cold_value_is_charged_per_new_process_start() -> None:
    p = LadderPolicy(latency_value=10.0, cold_value=5.0)
    np.testing.assert_allclose(p.start_value(), 10.0 * p.costs.start_s() + np.array([0, 0, 5.0, 5.0, 5.0]))


def test_ladder_smoothing_fills_a_hole_between_arrivals() -> None:
    smooth = LadderPolicy(prior_weight=1e-6, latency_value=1e4)     # smooth_weight 1: one pseudo-period at risk
    h = history(BURSTS, smooth)
    # Cell 2 [0.469, 0.9375): 5 of 60 periods reach it, none ends in it; its neighbourhood (cells 1-3) sees
    # 10 of 20 periods at risk end: shrunk by 1/60 of a period at a hazard of 0.5, (0 + 0.5 / 60) / (5/60 + 1/60).
    assert smooth.hazards(h.table())[0, 2] == pytest.approx(1 / 12, rel=1e-5)
    # Hot there costs 250 MB x 0.469 s + 1e4 x (1/12) x 0.3 ms = 117 MB*s, nothing 1e4 x (1/12) x 12.5 s = 10,417.
    plan = smooth.plan(h)
    assert plan.rung_at(0.6) == H and plan.rung_at(0.1) == H
    assert F not in {plan.rung_at(t) for t in (0.3, 0.6, 1.0, 3.0)}


def test_ladder_pseudo_arrivals_fill_a_hole_many_periods_cross() -> None:
    """20 idle periods of 10.5 minutes and 20 of 20.5: the minutes between are crossed by 20 periods each and see
    no arrival. A pseudo-period fades against 20 real ones; a pseudo-arrival does not, and it is drawn from the
    narrowest neighbourhood holding one (by hand for minute 15, cell 23: 8 cells either side, minutes 7 to 23,
    hold the 40 arrivals of minutes 10 and 20 over 4 x 40 + 10 x 20 periods at risk: a hazard of 1/9)."""
    h = history([630.0] * 20 + [1230.0] * 20, LadderPolicy())
    periods = LadderPolicy(prior_weight=1e-6, smooth_weight=1.0, latency_value=1e4)
    arrivals = LadderPolicy(prior_weight=1e-6, smooth_weight=0.0, smooth_events=1.0, latency_value=1e4)
    assert arrivals.cell_starts()[23] == 15 * 60.0
    assert periods.hazards(h.table())[0, 23] == pytest.approx(0.0, abs=1e-6)      # the hole stays
    assert arrivals.hazards(h.table())[0, 23] == pytest.approx(1 / 29, rel=1e-4)   # (0 + 1) / (20 + 1 / (1/9))
    # Minute 10 has its own 20 arrivals of 40 at risk: one pseudo-arrival at its neighbourhood's hazard (minutes 9
    # to 11: 20 of 40 + 40 + 20) barely moves it, (20 + 1) / (40 + 1 / 0.2).
    assert arrivals.hazards(h.table())[0, 18] == pytest.approx(21 / 45, rel=1e-4)
    assert LadderPolicy(smooth_events=0.0).hazards(h.table()).tolist() == LadderPolicy().hazards(h.table()).tolist()


def test_ladder_pseudo_arrivals_stay_on_their_side_of_the_head() -> None:
    """A neighbourhood holding the pseudo-arrivals is sought among the head cells or among the bins, never across:
    where in the first minute 30 idle periods ended (all within 0.05 s, or all at 20 s) does not move the hazard
    of any later cell, and a model called in sub-second bursts is not taken to be called again soon once idle for
    minutes (widened across the head, every minute up to the 25th borrowed the burst's hazard, 0.51 to 0.59, and
    the plan kept the model hot for 25 minutes after each burst; now 0.017 to 0.024, and hot for one)."""
    p = LadderPolicy(smooth_events=1.0)
    bursty, slower = (p.hazards(history([t] * 30, p).table())[0] for t in (0.05, 20.0))
    heads = p.head_splits + 1
    np.testing.assert_allclose(bursty[heads:], slower[heads:], rtol=1e-9)
    assert not np.allclose(bursty[:heads], slower[:heads])
    minutes = (p.cell_starts() >= 60.0) & (p.cell_starts() < 25 * 60.0)
    assert bursty[:len(minutes)][minutes].max() < 0.05
    plan = p.plan(history([0.05] * 30, p))
    assert plan.rung_at(59.0) == H and plan.rung_at(61.0) == Z


def test_ladder_drops_a_bursty_model_within_the_first_minute() -> None:
    """Mostly sub-second idle periods and a few of seconds: hot for the burst, then the zygote (per minute, the
    policy could only keep the model hot through the whole first minute)."""
    idle = [0.1] * 90 + [2.0] * 4 + [5.0] * 3 + [10.0] * 2 + [20.0]
    per_minute = LadderPolicy(latency_value=1e3, head_splits=0)
    assert per_minute.plan(history(idle, per_minute)).rung_at(59.0) == H
    fine = LadderPolicy(latency_value=1e3)
    plan = fine.plan(history(idle, fine))
    assert plan.rung_at(0.1) == H
    assert [plan.rung_at(t) for t in (2.0, 5.0, 10.0, 20.0)] == [Z] * 4
    assert plan.rung_at(59.0) != H


def test_ladder_decides_on_a_history_kept_without_head_cells() -> None:
    # A history kept per minute only (another policy's) still plans: the first minute is one cell.
    plan = LadderPolicy(latency_value=1e4).plan(history([0.1] * 90 + [20.0] * 10))
    assert plan.steps[0] == (0.0, H) and all(s == 0.0 or s >= 60.0 for s, _ in plan.steps)


def test_ladder_head_splits_must_be_whole() -> None:
    with pytest.raises(InvalidInput, match="head_splits"):
        LadderPolicy(head_splits=2.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="head_splits"):
        make_policy("ladder", head_splits=40.0)
    assert make_policy("ladder", head_splits=3.0).spec.head_splits == 3   # --knob passes floats


@pytest.mark.parametrize("policy", [HybridHistogram(), ladder(), FixedKeepAlive(300.0)], ids=lambda p: p.name)
def test_one_implementation_two_drivers(policy: HybridHistogram) -> None:
    """The simulator's batched table gives, row by row, the plans the live driver computes."""
    rng = np.random.default_rng(3)
    gaps = np.concatenate([rng.exponential(400, 30), rng.exponential(20000, 10), rng.exponential(30, 30),
                           rng.exponential(0.5, 30)])
    weights = rng.integers(1, 3, len(gaps))
    segs = np.sort(rng.integers(0, 40, len(gaps)))
    table = HistoryTable.build(policy.spec, gaps, weights, segs, 41)
    batched = policy.plans(table)
    live = policy.new_history()
    done = 0
    for row in range(41):
        while done < len(gaps) and segs[done] < row:
            live.observe(float(gaps[done]), int(weights[done]))
            done += 1
        want = policy.plan(live)
        got = batched.row(row)
        assert [r for _, r in got.steps] == [r for _, r in want.steps], f"row {row}"
        np.testing.assert_allclose([s for s, _ in got.steps], [s for s, _ in want.steps], rtol=1e-9)


@pytest.mark.parametrize(
    ("name", "knobs", "field"),
    [
        ("fixed", {"keep_alive_s": -1.0}, "keep_alive_s"),
        ("hybrid", {"tail_pct": 1.0}, "tail_pct"),
        ("hybrid", {"range_s": 10.0}, "range_s"),
        ("ladder", {"latency_value": -5.0}, "latency_value"),
        ("ladder", {"cold_value": -1.0}, "cold_value"),
        ("ladder-cold", {"cold_value": 1e16}, "cold_value"),
        ("ladder", {"zygote_share": 0.5}, "zygote_share"),
        ("fixed", {"bogus": 1.0}, "bogus"),
        ("magic", {}, "magic"),
    ],
)
def test_bad_policy_knobs_name_the_field(name: str, knobs: dict[str, float], field: str) -> None:
    with pytest.raises(InvalidInput, match=field):
        p = make_policy(name, **knobs)
        p.plan(p.new_history())


def test_idle_plan_walks_steps() -> None:
    plan = IdlePlan(((0.0, F), (100.0, H), (200.0, Z)))
    assert [plan.rung_at(t) for t in (0, 99, 100, 150, 200, 1e9)] == [F, F, H, H, Z, Z]
    assert (plan.prewarm_s, plan.keepalive_s) == (100.0, 100.0)


def test_history_rejects_bad_idle_time_and_spec() -> None:
    with pytest.raises(InvalidInput, match="idle time"):
        IdleHistory().observe(float("nan"))
    with pytest.raises(InvalidInput, match="range_s"):
        HistogramSpec(bin_s=60.0, range_s=30.0)


def test_a_request_that_comes_mid_climb_starts_from_the_rung_the_plan_climbs_from() -> None:
    start_s = RungCosts().start_s()                       # hot 0.3 ms, zygote 0.3 s, nothing 12.5 s
    plan = IdlePlan(((0.0, Rung.HOT), (10.0, Rung.ZYGOTE), (100.0, Rung.HOT)))
    assert start_rung(plan, 5.0, start_s) == Rung.HOT
    assert start_rung(plan, 50.0, start_s) == Rung.ZYGOTE
    assert start_rung(plan, 100.1, start_s) == Rung.ZYGOTE   # the instance forked at 100 s is ready at 100.2997
    assert start_rung(plan, 100.5, start_s) == Rung.HOT
    assert start_rung(plan, 100.1) == Rung.HOT == plan.rung_at(100.1)   # climbs taking no time
    down = IdlePlan(((0.0, Rung.HOT), (5.0, Rung.FETCH), (60.0, Rung.ZYGOTE)))
    assert start_rung(plan, 10.1, start_s) == Rung.ZYGOTE      # a drop is at once
    assert start_rung(down, 65.0, start_s) == Rung.FETCH       # the zygote made again from 60 s is ready at 72.2
    assert start_rung(down, 73.0, start_s) == Rung.ZYGOTE


def test_a_climb_back_from_nothing_is_a_zygote_start_s_where_the_zygote_is_up() -> None:
    start_s = RungCosts().start_s()                       # hot 0.3 ms, zygote 0.3 s, nothing 12.5 s
    table = PlanTable.of(IdlePlan(((0.0, Rung.HOT), (5.0, Rung.FETCH), (60.0, Rung.HOT))))
    origin, ready, since = table.chains(start_s)
    assert since[0].tolist() == [-np.inf, -np.inf, 60.0] and ready[0, 2] == pytest.approx(72.4997)
    assert origin[0].tolist() == [HOT, COLD, COLD]
    # Periods of 60.1, 61 and 80 s ended in the climb's step: the first two mid-climb (from nothing, alone).
    gaps = np.array([60.1, 61.0, 80.0])
    rows, steps = np.zeros(3, dtype=np.int64), np.full(3, 2)
    assert table.start_levels(rows, steps, gaps, start_s).tolist() == [COLD, COLD, HOT]
    began, up = table.fetch_climbs(rows, steps, gaps, start_s)
    assert began.tolist() == [60.0] * 3
    assert up.tolist() == [ZYGOTE, HOT, HOT]              # forked from the zygote at 60 s: hot at 60.2997
    # A chain (the zygote at 100, hot at 103.3) began at 100; with the zygote up it is hot at 103.5997.
    chain = PlanTable.of(IdlePlan(((0.0, Rung.HOT), (10.0, Rung.FETCH), (100.0, Rung.ZYGOTE), (103.3, Rung.HOT))))
    assert chain.chains(start_s)[2][0].tolist() == [-np.inf, -np.inf, 100.0, 100.0]
    began, up = chain.fetch_climbs(np.zeros(3, dtype=np.int64), np.array([2, 3, 3]), np.array([101.0, 103.4, 104.0]),
                                   start_s)
    assert began.tolist() == [100.0] * 3 and up.tolist() == [ZYGOTE, ZYGOTE, HOT]


def test_a_chain_of_climbs_starts_requests_from_where_it_began_until_its_last_is_done() -> None:
    start_s = RungCosts().start_s()
    # Nothing from 10 s; the zygote again at 100 (12.2 s to make), hot at 103.3 (0.2997 s more, after it).
    chain = IdlePlan(((0.0, Rung.HOT), (10.0, Rung.FETCH), (100.0, Rung.ZYGOTE), (103.3, Rung.HOT)))
    assert [start_rung(chain, t, start_s) for t in (101.0, 104.0, 112.3)] == [Rung.FETCH] * 3
    assert start_rung(chain, 112.6, start_s) == Rung.HOT
    # A drop during a climb: to nothing ends it; to the zygote (warmer than nothing) does not.
    to_nothing = IdlePlan(((0.0, Rung.HOT), (10.0, Rung.FETCH), (100.0, Rung.HOT), (105.0, Rung.FETCH)))
    assert start_rung(to_nothing, 106.0, start_s) == Rung.FETCH and start_rung(to_nothing, 120.0, start_s) == Rung.FETCH
    to_zygote = IdlePlan(((0.0, Rung.HOT), (10.0, Rung.FETCH), (100.0, Rung.HOT), (105.0, Rung.ZYGOTE)))
    assert start_rung(to_zygote, 106.0, start_s) == Rung.FETCH and start_rung(to_zygote, 113.0, start_s) == Rung.ZYGOTE


def test_decide_splits_spreads_a_head_cell_over_finer_ones_by_the_prior_s_shape() -> None:
    policy = LadderPolicy(head_splits=4, decide_splits=8, prior_min_s=0.01)
    sub = policy.grid(policy.spec).sub
    assert sub is not None
    # The first statistics cell [0, 3.75) in five: 0, 0.234, 0.469, 0.9375, 1.875; the later cells as they were.
    assert sub.starts.tolist() == pytest.approx([0.0, 0.234375, 0.46875, 0.9375, 1.875, 3.75, 7.5, 15.0, 30.0])
    assert sub.parent.tolist() == [0, 0, 0, 0, 0, 1, 2, 3, 4]
    # Log-uniform from 0.01 s, its density flat below: [0, 0.234) holds 1 + ln(23.4375) of the 1 + ln(375) in
    # [0, 3.75) (the 1: the flat part below 0.01 s), each halving ln 2.
    total = 1 + np.log(375.0)
    assert sub.share[:5] == pytest.approx([(1 + np.log(23.4375)) / total] + [np.log(2.0) / total] * 4)
    assert sub.share[5:].tolist() == [1.0] * 4
    assert sub.before[:5] == pytest.approx(np.cumsum(sub.share[:5]) - sub.share[:5])
    # Given idle at 0 with chance 0.8 of an arrival in [0, 3.75): the first sub-cell gets 0.8 x its share, the
    # second that of what is left, and a cell not split keeps its own held time.
    h, held = sub.split(np.array([[0.8], [0.5]]), np.array([[1.0], [2.0]]), 2)
    assert len(h) == len(sub.starts[sub.in_head(2)]) == 6 and h[0, 0] == pytest.approx(0.8 * sub.share[0])
    assert h[1, 0] == pytest.approx(0.8 * sub.share[1] / (1 - 0.8 * sub.share[0])) and h[5, 0] == 0.5
    assert held[5, 0] == 2.0 and 0 < held[0, 0] < 0.234375


def test_deciding_at_finer_cells_ends_a_short_hot_hold_sooner() -> None:
    history = IdleHistory(LadderPolicy(head_splits=4).spec)
    for gap in (0.1, 0.15, 0.2, 0.12, 5.0, 0.3, 0.1, 40.0, 0.2, 0.1, 0.15):
        history.observe(gap)
    coarse = LadderPolicy(head_splits=4, prior_min_s=0.01, latency_value=1778.0)
    fine = replace(coarse, decide_splits=8)
    assert coarse.plan(history).steps[:2] == ((0.0, Rung.HOT), (3.75, Rung.ZYGOTE))
    assert fine.plan(history).steps[:2] == ((0.0, Rung.HOT), (0.46875, Rung.ZYGOTE))
    # No finer than the statistics: the same plans.
    assert replace(coarse, decide_splits=4).plan(history) == coarse.plan(history)
    with pytest.raises(InvalidInput, match="decide_splits"):
        LadderPolicy(decide_splits=31)
    with pytest.raises(InvalidInput, match="decide_splits"):
        LadderPolicy(decide_splits=8.5)


def test_finer_cells_below_the_prior_s_lower_end_still_expect_arrivals() -> None:
    # A busy model (gaps of 0.05 to 0.3 s) with the prior from 1 s: the sub-cells below 1 s get the prior's density
    # at 1 s, not none (with none, "nothing kept" was free there and every plan began on it).
    history = IdleHistory(LadderPolicy(head_splits=4).spec)
    for gap in np.linspace(0.05, 0.3, 100):
        history.observe(float(gap))
    for value in (1e3, 1e5):
        coarse = LadderPolicy(head_splits=4, prior_min_s=1.0, latency_value=value)
        assert coarse.plan(history).steps[0] == (0.0, Rung.HOT)
        assert replace(coarse, decide_splits=8).plan(history).steps[0][1] != Rung.FETCH
    sub = LadderPolicy(head_splits=4, decide_splits=8, prior_min_s=1.0).grid(HistogramSpec(60.0, 4 * 3600.0, 4)).sub
    assert sub is not None and (sub.share > 0).all() and sub.divided.tolist() == [True] * 5 + [False] * 4


def _first_drop(plan: IdlePlan) -> float:
    return next(t for t, rung in plan.steps if rung == Rung.FETCH)


def test_rent_floor_holds_the_zygote_to_its_break_even_where_the_statistics_are_blind() -> None:
    # 60 idle periods of 0.05 to 0.3 s: no period seen has lasted a second, so beyond it the hazard is the prior's
    # guess, and the plan lets the zygote go within the first minute. At latency value 1,000 a start from the zygote
    # saves (12.5 - 0.3) x 1,000 = 12,200 MB*s against a fetch, and the zygote's rent is its 150 MB (the default
    # costs, a runtime of its own): its break-even time is 81.33 s. With the floor the zygote is held in every cell
    # the statistics cannot judge that begins before then: the drop comes at the first cell from 81.33 s on (the
    # minute bins: 120 s); at half the floor, from 40.67 s (60 s).
    history = IdleHistory(LadderPolicy().spec)
    for gap in np.linspace(0.05, 0.3, 60):
        history.observe(float(gap))
    policy = LadderPolicy(latency_value=1e3)
    assert _first_drop(policy.plan(history)) < 40.67
    assert _first_drop(replace(policy, rent_floor=1.0).plan(history)) == 120.0
    assert _first_drop(replace(policy, rent_floor=0.5).plan(history)) == 60.0
    with pytest.raises(InvalidInput, match="rent_floor"):
        LadderPolicy(rent_floor=-1.0)


def test_rent_floor_leaves_the_cells_the_statistics_can_judge_to_the_forecast() -> None:
    # 1,000 periods of 200 to 210 s: every cell before the break-even time (81.33 s) was reached by all 1,000 and
    # saw no arrival. At the break-even hazard (150 MB x 60 s / 12,200 MB*s = 0.74 per minute cell) they would have
    # shown ~740: the statistics can tell, and the plan (nothing kept, then the zygote back before 200 s) stands.
    history = IdleHistory(LadderPolicy().spec)
    for gap in np.linspace(200.0, 210.0, 1000):
        history.observe(float(gap))
    policy = LadderPolicy(latency_value=1e3)
    plan = policy.plan(history)
    assert _first_drop(plan) < 60.0
    assert replace(policy, rent_floor=1.0).plan(history) == plan
    # Judged cell by cell: with 12 head splits the first cells are under 0.081 s wide (12,200 / (1,000 x 150)), so
    # at the break-even hazard even 1,000 periods would show under one arrival in each: blind, the zygote is held
    # through them (to 0.117 s, where the cells are wide enough to judge), and the forecast decides from there.
    fine = IdleHistory(LadderPolicy(head_splits=12).spec)
    for gap in np.linspace(200.0, 210.0, 1000):
        fine.observe(float(gap))
    policy = LadderPolicy(latency_value=1e3, head_splits=12)
    assert policy.plan(fine).steps[0] == (0.0, Rung.FETCH)
    rented = replace(policy, rent_floor=1.0).plan(fine).steps
    assert rented[:2] == ((0.0, Rung.ZYGOTE), (pytest.approx(60 / 2 ** 9), Rung.FETCH))
    assert rented[2:] == policy.plan(fine).steps[1:]


@pytest.mark.parametrize("n", [1, 5, 9, 12, 28, 76, 200])
def test_ladder_hazards_of_the_first_cells_are_the_whole_s(n: int) -> None:
    # With pseudo-arrivals a cell's hazard rests on up to 32 cells either side (a head cell's, anywhere in the
    # head): the first n cells' hazards are gathered from as many as they rest on (with one more only, cells 13 to
    # 27 of 28 differed on a synthetic day).
    # Arrivals in the first and the last head cell and every 20 minutes: the cells between borrow from far.
    idle = [0.05] * 100 + [40.0] * 30 + [1200.0 * k + 30.0 for k in range(1, 12)] * 3
    policy = ladder(smooth_events=1.0, smooth_weight=0.0, head_splits=8)
    table = history(idle, policy).table()
    np.testing.assert_array_equal(policy.hazards(table, n), policy.hazards(table)[:, :n])
