"""The simulator against closed forms and against an event-by-event replay of the live driver."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ember.core.rung_costs import RungCosts
from ember.core.states import Rung
from ember.keepalive.idle_plan import LEVELS, ZYGOTE, KeepAlivePolicy, start_rung
from ember.keepalive.policies import FixedKeepAlive, FixedZygote, HybridHistogram, LadderPolicy
from ember.sim.engine import REFRESH_EACH_FIRST, REFRESH_S, poisson_trace, simulate
from ember.sim.runner import build_policies, compare, run_policies
from ember.sim.synthetic import SyntheticConfig, synthetic_trace
from ember.sim.traces import AppTrace, Trace

COSTS = RungCosts()
HOT, FETCH = LEVELS.index(Rung.HOT), LEVELS.index(Rung.FETCH)


@pytest.mark.parametrize("keep_alive_s", [30.0, 100.0, 300.0])
def test_poisson_fixed_keepalive_closed_form(keep_alive_s: float) -> None:
    """Poisson arrivals, rate lambda, keep-alive T: P(cold) = e^(-lambda T), E[held] = (1 - e^(-lambda T)) / lambda."""
    lam, horizon = 1 / 100, 4e6
    trace = poisson_trace(lam, horizon, seed=11)
    r = simulate(trace, FixedKeepAlive(keep_alive_s), COSTS)
    n = r.invocations
    p = math.exp(-lam * keep_alive_s)
    assert abs(r.starts[FETCH] / n - p) < 4 * math.sqrt(p * (1 - p) / n)
    assert r.starts[HOT] + r.starts[FETCH] == n
    held = (1 - p) / lam
    assert r.idle_s[HOT] / n == pytest.approx(held, rel=0.03)
    # The hot instance holds its runtime's zygote too (the live node's rule): one app, so exactly its hot time.
    assert r.total_idle_mb_s == pytest.approx(r.idle_s[HOT] * (COSTS.hot.idle_mb + COSTS.zygote.idle_mb))


def test_deterministic_with_a_seed() -> None:
    a = simulate(poisson_trace(0.01, 1e5, seed=1, apps=3), HybridHistogram(), COSTS)
    b = simulate(poisson_trace(0.01, 1e5, seed=1, apps=3), HybridHistogram(), COSTS)
    c = simulate(poisson_trace(0.01, 1e5, seed=2, apps=3), HybridHistogram(), COSTS)
    np.testing.assert_array_equal(a.starts, b.starts)
    assert a.total_idle_mb_s == b.total_idle_mb_s
    assert not np.array_equal(a.idle_s, c.idle_s)


def test_arrivals_during_execution_find_the_instance_hot() -> None:
    # Each execution lasts 10 s, arrivals 5 s apart: every start after the first is hot, nothing idles in between.
    t = np.arange(0, 50, 5.0)
    app = AppTrace("busy", t, np.ones(len(t), dtype=np.int64), np.zeros(len(t)), np.full(len(t), 10.0))
    r = simulate(Trace("t", "test", 55.0 + 10, [app]), FixedKeepAlive(1.0), COSTS)
    assert r.starts[FETCH] == 1 and r.starts[HOT] == len(t) - 1
    assert r.idle_s[HOT] == pytest.approx(1.0)          # only after the last execution (until the keep-alive ends)


def test_minute_groups_equal_explicit_arrivals() -> None:
    """A minute of k evenly spaced arrivals is the same as k single arrivals (after the first arrivals)."""
    rng = np.random.default_rng(5)
    minutes = np.sort(rng.choice(600, 120, replace=False))
    k = rng.integers(1, 6, len(minutes))
    k[:REFRESH_EACH_FIRST] = 1          # the first arrivals refresh one by one in both forms
    spacing = 60.0 / k
    starts = minutes * 60.0 + rng.random(len(minutes)) * spacing
    grouped = AppTrace("g", starts, k, spacing, np.full(len(k), 0.5))
    single = np.concatenate([s + np.arange(n) * sp for s, n, sp in zip(starts, k, spacing, strict=True)])
    explicit = AppTrace("e", single, np.ones(len(single), dtype=np.int64), np.zeros(len(single)),
                        np.full(len(single), 0.5))
    for policy in (FixedKeepAlive(120.0), HybridHistogram(), LadderPolicy(zygote_share=10)):
        a = simulate(Trace("g", "t", 36000.0, [grouped]), policy, COSTS)
        b = simulate(Trace("e", "t", 36000.0, [explicit]), policy, COSTS)
        np.testing.assert_allclose(a.starts, b.starts)
        np.testing.assert_allclose(a.idle_s, b.idle_s, rtol=1e-9, atol=1e-6)


def replay(app: AppTrace, horizon: float, policy: KeepAlivePolicy) -> tuple[np.ndarray, np.ndarray]:
    """Event by event, as the live server would: observe each idle period; refresh the plan at each of the
    first groups of arrivals, then at the first arrival of each new minute, and once more after the last
    execution, for the trailing idle period (made from every period seen)."""
    arrivals = np.concatenate([s + np.arange(n) * sp for s, n, sp in zip(app.starts, app.counts, app.spacing,
                                                                         strict=True)])
    durations = np.repeat(app.durations, app.counts)
    history = policy.new_history()
    starts, idle = np.zeros(len(LEVELS)), np.zeros(len(LEVELS))
    plan = policy.plan(history)
    starts[FETCH] += 1                       # the first arrival: a compulsory cold start
    group_of = np.repeat(np.arange(len(app.counts)), app.counts)
    key = arrivals[0] / REFRESH_S
    end = arrivals[0] + durations[0]

    def hold(gap: float) -> None:
        for (s0, rung), nxt in zip(plan.steps, [*(s for s, _ in plan.steps[1:]), math.inf], strict=True):
            idle[LEVELS.index(rung)] += max(0.0, min(gap, nxt) - s0)

    for t, d, g, g_prev in zip(arrivals[1:], durations[1:], group_of[1:], group_of[:-1], strict=True):
        gap = t - end
        if gap < 0:
            starts[HOT] += 1
        else:
            starts[LEVELS.index(start_rung(plan, gap, COSTS.start_s()))] += 1   # mid-climb: the rung it left
            hold(gap)
        history.observe(gap)
        new_key = t / REFRESH_S if g < REFRESH_EACH_FIRST else max(key, math.floor(t / REFRESH_S))
        if g != g_prev and new_key > key:
            key = new_key
            plan = policy.plan(history)
        end = max(end, t + d)                # idle runs from the latest end of any execution
    plan = policy.plan(history)
    hold(max(0.0, horizon - end))
    return starts, idle


@pytest.mark.parametrize("policy", [HybridHistogram(range_s=3600.0), LadderPolicy(zygote_share=20, latency_value=3e4),
                                    FixedKeepAlive(200.0)], ids=lambda p: p.name)
def test_engine_equals_event_by_event_replay(policy: KeepAlivePolicy) -> None:
    trace = synthetic_trace(SyntheticConfig(apps=25, seed=9))
    per_invocation = poisson_trace(1 / 40, 20000.0, seed=4, apps=2, duration_s=0.5)
    for app in [*trace.apps, *per_invocation.apps]:
        if app.invocations > 20_000:
            continue
        got = simulate(Trace("one", "t", trace.horizon_s, [app]), policy, COSTS)
        want_starts, want_idle = replay(app, trace.horizon_s, policy)
        np.testing.assert_allclose(got.starts, want_starts, err_msg=app.name)
        np.testing.assert_allclose(got.idle_s, want_idle, rtol=1e-7, atol=1e-3, err_msg=app.name)


def test_ladder_beats_hybrid_zygote_at_most_of_its_points_on_a_synthetic_day() -> None:
    # The ladder as the held-out evaluation runs it (its fixed constants: the pooled prior and one pseudo-arrival
    # per cell). On a day of 150 applications on 4 runtimes every runtime's zygote is up all day, so hybrid's
    # starts from nothing kept are zygote starts, as hybrid-zygote's are: the two hold the same memory, and hybrid's
    # mean is at most 1% higher (its climbs from nothing back to hot are counted as taking a full start). (While the
    # engine charged those starts as full fetches, the ladder at its class defaults beat hybrid at all 6 points;
    # counted as the live node counts them, it beats neither at any: docs/policies.md.)
    trace = synthetic_trace(SyntheticConfig(apps=150, seed=1))
    knobs = {"ladder": {"pooled_weight": 1.0, "smooth_events": 1.0}}
    policies = build_policies(["hybrid", "hybrid-zygote", "ladder"], knobs, COSTS, zygote_share=150 / 4)
    hybrid, hybrid_zygote, ladder = run_policies(trace, policies, COSTS, runtimes=4)
    for h, hz in zip(hybrid.points(), hybrid_zygote.points(), strict=True):
        assert h.total_idle_mb_s == pytest.approx(hz.total_idle_mb_s, rel=1e-9)
        assert hz.latency_mean(COSTS) <= h.latency_mean(COSTS) <= hz.latency_mean(COSTS) * 1.01
    rows = compare(ladder, hybrid_zygote, COSTS)
    # At the two cheapest (30 and 60-minute ranges) hybrid-zygote holds the lower mean at the same memory.
    assert len(rows) == 6 and sum(r["ladder_wins_same_memory"] for r in rows) >= len(rows) / 2
    assert sum(r["ladder_wins_same_latency"] for r in rows) >= len(rows) / 2


def paused_services(seed: int, horizon: float = 3600.0, apps: int = 2) -> Trace:
    """Services like the Azure LLM trace's: requests ~0.5 s apart (Poisson), one gap in 600 a pause of 10-240 s."""
    rng = np.random.default_rng(seed)
    out = []
    for a in range(apps):
        gaps = rng.exponential(0.5, int(horizon * 4))
        pauses = rng.random(len(gaps)) < 1 / 600
        gaps[pauses] = rng.uniform(10.0, 240.0, int(pauses.sum()))
        t = np.cumsum(gaps)
        t = t[t < horizon]
        out.append(AppTrace(f"svc{a}", t, np.ones(len(t), dtype=np.int64), np.zeros(len(t)), np.zeros(len(t))))
    return Trace("paused", "test", horizon, out)


@pytest.mark.parametrize("seed", [0, 1])
def test_ladder_beats_hybrid_on_busy_services_alone_on_their_runtime(seed: int) -> None:
    """Each service alone on its runtime (its zygote costs 150 MB): the hybrid policy keeps it hot ~a minute
    after every request; the ladder keeps it hot for a few seconds, then on the zygote through the pauses."""
    trace = paused_services(seed)
    policies = build_policies(["hybrid", "ladder"], {}, COSTS, zygote_share=1.0)
    hybrid, ladder = run_policies(trace, policies, COSTS, runtimes=2)
    rows = compare(ladder, hybrid, COSTS)
    assert rows and all(r["ladder_wins_same_memory"] for r in rows)
    assert all(r["ladder_wins_same_latency"] for r in rows)


def test_zygotes_are_charged_per_runtime() -> None:
    """A runtime's zygote costs its memory while any of its models holds it (from its first start, but on FETCH)."""
    zyg = LEVELS.index(Rung.ZYGOTE)
    trace = poisson_trace(1 / 20000, 86400.0, seed=3, apps=8)
    r = simulate(trace, LadderPolicy(zygote_share=8, latency_value=1e6), COSTS, runtimes=1)
    assert r.starts[zyg] > 0 and r.idle_s[zyg] > 86400.0           # rare models sit on the zygote
    first = min(a.starts[0] for a in trace.apps)
    assert r.idle_s[FETCH] == 0.0 and r.shared_mb_s == pytest.approx(COSTS.zygote.idle_mb * (86400.0 - first))
    assert r.idle_mb_s[zyg] == 0.0
    single = Trace("one", "t", 86400.0, trace.apps[:1])
    one = simulate(single, LadderPolicy(zygote_share=1, latency_value=1e4), COSTS, runtimes=1)
    assert one.idle_s[FETCH] > 0.0
    held = 86400.0 - trace.apps[0].starts[0] - one.idle_s[FETCH]
    assert one.shared_mb_s == pytest.approx(held * COSTS.zygote.idle_mb)


def single(*arrivals: tuple[float, float]) -> AppTrace:
    t = np.array([a for a, _ in arrivals])
    return AppTrace("a", t, np.ones(len(t), dtype=np.int64), np.zeros(len(t)), np.array([d for _, d in arrivals]))


@pytest.mark.parametrize("policy", [FixedKeepAlive(10.0), HybridHistogram(), LadderPolicy(zygote_share=10)],
                         ids=lambda p: p.name)
def test_the_first_invocation_is_a_cold_start_with_nothing_held_before_it(policy: KeepAlivePolicy) -> None:
    # By hand: one arrival at t = 100 s: a cold start (whatever the empty-history plan holds), and no memory
    # charged for the 100 s before it.
    r = simulate(Trace("t", "test", 200.0, [single((100.0, 1.0))]), policy, COSTS)
    assert r.starts[FETCH] == 1 and r.starts.sum() == 1
    first_plan_forever = policy.plan(policy.new_history()).steps
    assert r.idle_s.sum() == pytest.approx(200.0 - 101.0), first_plan_forever   # only after its execution ends


def test_idle_time_runs_from_the_latest_end_not_the_last_arrival() -> None:
    # By hand, keep-alive 10 s: a 100 s execution from t = 0; arrivals at 10 s and 50 s (1 s each) come while it
    # runs: both hot. The instance idles only from t = 100: 10 s held hot, then nothing. (Measured from the last
    # arrival's end, 51 s, the arrival at 50 s would have followed a 39 s idle period: a cold start.)
    r = simulate(Trace("t", "test", 200.0, [single((0.0, 100.0), (10.0, 1.0), (50.0, 1.0))]), FixedKeepAlive(10.0),
                 COSTS)
    assert (r.starts[FETCH], r.starts[HOT]) == (1, 2)
    assert r.idle_s[HOT] == pytest.approx(10.0) and r.idle_s[:FETCH].sum() == pytest.approx(10.0)


def test_a_group_partly_covered_by_an_earlier_execution_equals_its_arrivals_one_by_one() -> None:
    # Group 1: one arrival at 0 s running 75 s. Group 2: 3 arrivals 20 s apart from 60 s, 1 s each: the one at
    # 60 s is busy, the one at 80 s follows 5 s of idle (from 75 s), the one at 100 s follows 19 s (from 81 s).
    grouped = AppTrace("g", np.array([0.0, 60.0]), np.array([1, 3]), np.array([0.0, 20.0]), np.array([75.0, 1.0]))
    explicit = single((0.0, 75.0), (60.0, 1.0), (80.0, 1.0), (100.0, 1.0))
    for policy in (FixedKeepAlive(10.0), FixedKeepAlive(2.0)):
        a = simulate(Trace("g", "t", 300.0, [grouped]), policy, COSTS)
        b = simulate(Trace("e", "t", 300.0, [explicit]), policy, COSTS)
        np.testing.assert_allclose(a.starts, b.starts)
        np.testing.assert_allclose(a.idle_s, b.idle_s)
    short = simulate(Trace("g", "t", 300.0, [grouped]), FixedKeepAlive(10.0), COSTS)
    assert (short.starts[FETCH], short.starts[HOT]) == (2, 2)          # the first, and after 19 s > 10 s
    cold = simulate(Trace("g", "t", 300.0, [grouped]), FixedKeepAlive(2.0), COSTS)
    assert (cold.starts[FETCH], cold.starts[HOT]) == (3, 1)


def test_fixed_zygote_drops_to_the_zygote_and_pays_its_start_not_a_fetch() -> None:
    # By hand, keep-alive 10 s: arrivals at 0 s and 100 s (instant executions), horizon 150 s. The second
    # follows 100 s of idle: 10 s hot, 90 s on the zygote, so it starts from the zygote; then 10 s hot and
    # 40 s on the zygote to the horizon.
    r = simulate(Trace("t", "test", 150.0, [single((0.0, 0.0), (100.0, 0.0))]), FixedZygote(10.0), COSTS)
    assert (r.starts[FETCH], r.starts[ZYGOTE]) == (1, 1)
    assert r.idle_s[HOT] == pytest.approx(20.0) and r.idle_s[ZYGOTE] == pytest.approx(130.0)


def test_a_memory_tier_copy_is_charged_on_every_rung_but_nothing_kept() -> None:
    # By hand, as above with a 40 MB copy in the memory tier, kept on every rung but nothing: 130 s on the zygote
    # rung cost 130 x 40 MB of the model's own, 20 s hot 20 x (250 + 40) MB, and the zygote itself is still
    # charged once, for the 150 s it is up.
    costs = RungCosts(memory_copy_mb=40.0)
    r = simulate(Trace("t", "test", 150.0, [single((0.0, 0.0), (100.0, 0.0))]), FixedZygote(10.0), costs)
    assert r.idle_mb_s[ZYGOTE] == pytest.approx(130.0 * 40.0) and r.idle_mb_s[HOT] == pytest.approx(20.0 * 290.0)
    assert r.shared_mb_s == pytest.approx(150.0 * costs.zygote.idle_mb)


def test_one_idle_time_is_not_a_histogram_for_the_hybrid_policy() -> None:
    # The paper falls back to the standard keep-alive until the histogram is representative: with fewer idle
    # times than `min_samples`, the plan is "hot for the whole range" even though one sample looks certain.
    policy = HybridHistogram(min_samples=10)
    history = policy.new_history()
    history.observe(600.0)
    assert policy.plan(history).steps == ((0.0, Rung.HOT), (policy.range_s, Rung.FETCH))
    for _ in range(9):
        history.observe(600.0)
    assert policy.plan(history).steps[0] != (0.0, Rung.HOT)   # now a pre-warm window from the histogram


@pytest.mark.parametrize("latency_value", [1e3, 1e5])
def test_the_ladder_planned_many_applications_per_call_plans_as_one_per_call(latency_value: float) -> None:
    """The first pass plans a batch of applications' rows in one call (their columns unioned): same results."""
    trace = synthetic_trace(SyntheticConfig(apps=40, seed=3))
    policy = LadderPolicy(zygote_share=20.0, latency_value=latency_value)
    one = simulate(trace, policy, RungCosts(), runtimes=2, batch_apps=1)
    many = simulate(trace, policy, RungCosts(), runtimes=2, batch_apps=16)
    assert one.starts.tolist() == many.starts.tolist()
    assert np.allclose(one.idle_s, many.idle_s) and np.isclose(one.shared_mb_s, many.shared_mb_s)
    assert np.allclose(one.app_cold, many.app_cold)


def test_the_trailing_idle_period_is_planned_from_every_period_seen() -> None:
    """An application whose day is one minute's burst (14 arrivals 4 s apart, each running 7.5 s: 13 arrivals while
    busy, idle 0 s each), then nothing: the live node plans the idle period after its last execution from those 13
    periods, and so does the simulator (its own refresh point). Planned from no history (the minute's refresh
    point, before the burst), the ATC objective at a high value kept it hot for the rest of the day."""
    app = AppTrace("burst", np.array([100.0]), np.array([14]), np.array([4.0]), np.array([7.5]))
    policy = LadderPolicy(latency_value=0.0, cold_value=1e9, cold_per_app=True)
    r = simulate(Trace("t", "test", 86400.0, [app]), policy, COSTS)
    assert r.starts[FETCH] == 1 and r.starts[HOT] == 13
    assert r.idle_s[:FETCH].sum() < 60.0
    want_starts, want_idle = replay(app, 86400.0, policy)
    np.testing.assert_allclose(r.starts, want_starts)
    np.testing.assert_allclose(r.idle_s, want_idle, rtol=1e-7, atol=1e-3)
