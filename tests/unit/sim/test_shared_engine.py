"""The shared-node engine by hand (FaaSCache's greedy-dual order, the live LRU order) and against the
per-application engine where no eviction happens."""

from __future__ import annotations

import numpy as np
import pytest

from ember.core.rung_costs import RungCost, RungCosts
from ember.errors import InvalidInput
from ember.keepalive.idle_plan import COLD, HOT, ZYGOTE
from ember.keepalive.policies import FixedKeepAlive
from ember.sim.engine import simulate
from ember.sim.greedy_dual import FaaSCache, LruEvict
from ember.sim.shared_engine import simulate_shared
from ember.sim.synthetic import SyntheticConfig, synthetic_trace
from ember.sim.traces import AppTrace, Trace

COSTS = RungCosts(hot=RungCost(100.0, 0.0003), paused=RungCost(100.0, 0.0008))   # instances of 100 MB
BUDGET_2 = 0.2    # GB: 204.8 MB, two instances


def app(name: str, *arrivals: float, duration: float = 0.0) -> AppTrace:
    t = np.array(arrivals)
    return AppTrace(name, t, np.ones(len(t), dtype=np.int64), np.zeros(len(t)), np.full(len(t), duration))


TRACE = Trace("t", "test", 30.0, [app("A", 0.0, 1.0, 10.0), app("B", 2.0, 20.0), app("C", 3.0)])


def test_faascache_evicts_the_least_greedy_dual_priority() -> None:
    # Two instances fit. t=3: C needs room; idle are A (idle since 1, used twice: clock 0 + 2c) and B (since 2,
    # once: 0 + c): B goes, clock = c. t=10: A is hot. t=20: B starts from the zygote (17 s on it); idle are A
    # (since 10, 3 uses: c + 3c) and C (since 3: c + c): C goes. Hot idle: A 1 + 9 + 20, B 1 + 10, C 17 = 58 s;
    # zygote: B 17 + C 10 = 27 s.
    r = simulate_shared(TRACE, FaaSCache(BUDGET_2), COSTS)
    assert (r.starts[COLD], r.starts[ZYGOTE], r.starts[HOT]) == (3, 1, 2) and r.invocations == 6
    assert r.idle_s[HOT] == pytest.approx(58.0) and r.idle_s[ZYGOTE] == pytest.approx(27.0)
    # The runtime's zygote: held from A's first start (0) to the end (30 s), nothing ever dropping below it.
    assert r.total_idle_mb_s == pytest.approx(58.0 * 100 + 30.0 * COSTS.zygote.idle_mb)
    np.testing.assert_allclose(sorted(r.app_cold), [1 / 3, 1.0, 1.0])
    assert r.over_budget == 0


def test_the_live_lru_order_evicts_the_longest_idle_instead() -> None:
    # t=3: A (idle since 1) goes. t=10: A from the zygote (7 s), B (since 2) goes. t=20: B from the zygote (10 s),
    # C (since 3) goes. Hot idle: A 1 + 2 + 20, B 8 + 10, C 17 = 58 s; zygote: 7 + 10 + 10 = 27 s.
    r = simulate_shared(TRACE, LruEvict(BUDGET_2), COSTS)
    assert (r.starts[COLD], r.starts[ZYGOTE], r.starts[HOT]) == (3, 2, 1)
    assert r.idle_s[HOT] == pytest.approx(58.0) and r.idle_s[ZYGOTE] == pytest.approx(27.0)


def test_busy_instances_are_not_evicted_the_start_goes_over_budget() -> None:
    # One instance fits (102.4 MB). B arrives while A runs (0-10 s): over budget. At 20 s C needs room: both idle,
    # both are evicted (A first: same priority, idle longer) until C fits.
    trace = Trace("t", "test", 30.0, [app("A", 0.0, duration=10.0), app("B", 1.0), app("C", 20.0)])
    r = simulate_shared(trace, FaaSCache(0.1), COSTS)
    assert r.over_budget == 1 and r.starts[COLD] == 3
    assert r.idle_s[HOT] == pytest.approx(10.0 + 19.0 + 10.0)          # A 10-20, B 1-20, C 20-30
    assert r.idle_s[ZYGOTE] == pytest.approx(20.0)                     # A and B on the zygote 20-30


def test_without_evictions_it_equals_keeping_every_instance_forever() -> None:
    """A budget nothing fills: the shared engine must agree with the per-application engine's keep-forever,
    groups of per-minute arrivals and executions overlapping the next arrivals included."""
    trace = synthetic_trace(SyntheticConfig(apps=25, seed=9))
    got = simulate_shared(trace, FaaSCache(1e5), COSTS, runtimes=2)
    want = simulate(trace, FixedKeepAlive(1e12), COSTS, runtimes=2)
    np.testing.assert_allclose(got.starts, want.starts)
    np.testing.assert_allclose(got.idle_s, want.idle_s, rtol=1e-9)
    np.testing.assert_allclose(np.sort(got.app_cold), np.sort(want.app_cold))


def test_budget_must_be_positive() -> None:
    with pytest.raises(InvalidInput, match="budget_gb"):
        FaaSCache(0.0)
