"""The LP warm pool on the shared-node engine: a tiny trace by hand, and keep-forever parity without pressure."""

from __future__ import annotations

import numpy as np
import pytest

from ember.core.rung_costs import RungCost, RungCosts
from ember.keepalive.idle_plan import COLD, HOT, ZYGOTE
from ember.keepalive.policies import FixedKeepAlive
from ember.sim.engine import simulate
from ember.sim.greedy_dual import FaaSCache, LpBuffer
from ember.sim.shared_engine import simulate_shared
from ember.sim.synthetic import SyntheticConfig, synthetic_trace
from ember.sim.traces import AppTrace, Trace

COSTS = RungCosts(hot=RungCost(100.0, 0.0003), paused=RungCost(100.0, 0.0008))   # instances of 100 MB
ONE = 0.1    # GB: 102.4 MB, one instance


def app(name: str, arrivals: list[float]) -> AppTrace:
    t = np.array(arrivals)
    return AppTrace(name, t, np.ones(len(t), dtype=np.int64), np.zeros(len(t)), np.zeros(len(t)))


# A every 10 s but for a gap at 60 s; B at 55 s and 205 s.
A = [float(t) for t in range(0, 300, 10) if t != 60]
TRACE = Trace("t", "test", 300.0, [app("A", A), app("B", [55.0, 205.0])])


def test_the_plan_keeps_the_app_more_likely_to_arrive_and_prewarms_it() -> None:
    # Room for one instance; latency_value 1e6 makes any instance with P(arrival in the minute) > 0.02 worth
    # its memory, so the budget decides. 55 s: B's first start evicts idle A. The 60 s plan: A (idle 10 s,
    # five 10 s idle periods seen) is near-certain to arrive within the minute, B (idle 5 s, no period seen:
    # the prior) far less: A is loaded back from the zygote, B drops to it. 70-200 s: A hot. 205 s: B from the
    # zygote (evicting idle A), 210 s: A from the zygote (evicting B); the plans at 120, 180, 240 and 300 s keep A.
    r = simulate_shared(TRACE, LpBuffer(ONE, latency_value=1e6), COSTS)
    assert (r.starts[COLD], r.starts[ZYGOTE], r.starts[HOT]) == (2, 2, 27) and r.invocations == 31
    assert r.prewarms == 1 and r.over_budget == 0
    # Hot idle: A 0-55, 60-205, 210-300 (290 s), B 55-60, 205-210 (10 s); zygote: A 55-60, 205-210, B 60-205, 210-300.
    assert r.idle_s[HOT] == pytest.approx(300.0) and r.idle_s[ZYGOTE] == pytest.approx(245.0)
    # FaaSCache has no plan: A at 70 s starts from the zygote as well.
    f = simulate_shared(TRACE, FaaSCache(ONE), COSTS)
    assert (f.starts[COLD], f.starts[ZYGOTE], f.starts[HOT]) == (2, 3, 26)


@pytest.mark.parametrize(("at", "zygote", "hot"), [(60.1, 3, 27), (60.5, 2, 28)])
def test_a_prewarm_takes_the_time_of_a_load_from_the_zygote(at: float, zygote: int, hot: int) -> None:
    # As above, with one more arrival of A just after the 60 s plan loads it back from the zygote: the load
    # takes a zygote start's 0.3 s less a hot start's 0.3 ms, so at 60.1 s A waits for it (a zygote start, as the
    # per-application engine counts an arrival during a climb) and at 60.5 s finds it hot.
    trace = Trace("t", "test", 300.0, [app("A", sorted([*A, at])), app("B", [55.0, 205.0])])
    r = simulate_shared(trace, LpBuffer(ONE, latency_value=1e6), COSTS)
    assert r.prewarms == 1 and r.invocations == 32
    assert (r.starts[COLD], r.starts[ZYGOTE], r.starts[HOT]) == (2, zygote, hot)


def test_only_the_first_start_during_a_load_waits_for_it() -> None:
    # Two more arrivals of A, at 60.1 s and 60.15 s (executions of no length): the first waits for the load the 60 s
    # plan began (a zygote start); the second comes in its own idle period, after an execution, and is counted hot,
    # as the per-application engine counts the arrival after one that came during a climb.
    trace = Trace("t", "test", 300.0, [app("A", sorted([*A, 60.1, 60.15])), app("B", [55.0, 205.0])])
    r = simulate_shared(trace, LpBuffer(ONE, latency_value=1e6), COSTS)
    assert r.prewarms == 1 and r.invocations == 33
    assert (r.starts[COLD], r.starts[ZYGOTE], r.starts[HOT]) == (2, 3, 28)


def test_an_instance_not_worth_its_memory_drops_to_the_zygote_at_the_next_plan() -> None:
    # At latency_value 3e4 an idle minute of 100 MB pays if P(arrival in the minute) > 6,000 / (3e4 * 0.2997)
    # = 0.67. B, one arrival (the prior only: about 0.26 after 5 s idle), is below that at the 60 s plan:
    # dropped, though the budget has room (1 GB).
    trace = Trace("t", "test", 120.0, [app("B", [55.0])])
    r = simulate_shared(trace, LpBuffer(1.0, latency_value=3e4), COSTS)
    assert r.idle_s[HOT] == pytest.approx(5.0) and r.idle_s[ZYGOTE] == pytest.approx(60.0)


def test_without_pressure_and_with_latency_priceless_it_keeps_every_instance_forever() -> None:
    trace = synthetic_trace(SyntheticConfig(apps=15, seed=4))
    got = simulate_shared(trace, LpBuffer(1e5, latency_value=1e15), COSTS, runtimes=2)
    want = simulate(trace, FixedKeepAlive(1e12), COSTS, runtimes=2)
    np.testing.assert_allclose(got.starts, want.starts)
    np.testing.assert_allclose(got.idle_s, want.idle_s, rtol=1e-9)
    assert got.prewarms == 0
