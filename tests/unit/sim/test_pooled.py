"""The simulator's pooled prior is causal: a refresh point's prior pools only periods that ended before it."""

from __future__ import annotations

import numpy as np
import pytest

from ember.core.keepalive import LadderPolicy
from ember.core.rung_costs import RungCosts
from ember.sim.engine import app_items, simulate
from ember.sim.pooled import POOL_EPOCH_S, trace_priors
from ember.sim.traces import AppTrace, Trace


def _app(name: str, starts: list[float]) -> AppTrace:
    n = len(starts)
    return AppTrace(name, np.array(starts), np.ones(n, dtype=np.int64), np.zeros(n), np.zeros(n))


def _priors(apps: list[AppTrace], horizon: float = 3600.0) -> tuple[object, dict[int, np.ndarray], list[object]]:
    items = [app_items(a, horizon) for a in apps]
    base, index = trace_priors(LadderPolicy(pooled_weight=1.0), items, list(range(len(apps))), horizon)
    return base, index, items


def test_each_refresh_point_uses_the_prior_of_the_periods_ended_before_its_epoch() -> None:
    busy = _app("busy", [0.0, 1.0, 2.0, 3.0])                  # three 1 s periods, ended by 3 s
    rare = _app("rare", [100.0, 1300.0, 3000.0])               # 1200 s (ends at 1300), 1700 s (ends at 3000)
    base, index, items = _priors([busy, rare])
    # Epochs at 0, 600, 1200, 1800, 2400, 3000 s: from 600 s both apps are pooled, the rare one by its period still
    # running (600 - 100 = 500 s so far: at least that long).
    assert base.apps.tolist()[:6] == [0, 2, 2, 2, 2, 2]
    for i, it in enumerate(items):
        assert (index[i] * POOL_EPOCH_S <= it.seg_t).all()      # never an epoch after the plan is made
    # The rare app's plan at 1300 s (its second arrival) uses the 1200 s epoch, from before the period ended.
    assert index[1].tolist() == [0, 2, 5]
    policy = LadderPolicy()
    starts = policy.cell_starts()
    cell = {t: int(np.searchsorted(starts, t, side="right") - 1) for t in (1.0, 1100.0, 1200.0)}
    # At 1200 s: the busy app's three 1 s periods, its last one running for 1197 s; the rare app's running 1100 s.
    # Each app's mass beyond what it has seen follows the log-uniform prior; none of it before 1100 s.
    assert base.mass[2, cell[1.0]] == pytest.approx(0.5 * 3 / 4)
    assert base.mass[2, cell[1.0] + 1: cell[1100.0]].sum() == pytest.approx(0.0)
    assert base.mass[2].sum() == pytest.approx(1.0)
    # At 1800 s the rare app's 1200 s period has ended, and its next one has run 500 s: by Kaplan-Meier all its mass
    # is in the 1200 s cell (the running period leaves the risk set before it), half the pool.
    assert base.mass[3, cell[1200.0]] >= 0.5 > base.mass[2, cell[1200.0]]


def test_the_future_changes_no_earlier_prior() -> None:
    early = [_app("a", [0.0, 5.0, 700.0]), _app("b", [10.0, 20.0, 1000.0])]
    later = [early[0], _app("b", [10.0, 20.0, 1000.0, 2500.0, 2510.0])]   # b goes on after 1800 s
    before, _, _ = _priors(early)
    after, _, _ = _priors(later)
    upto = int(2500.0 // POOL_EPOCH_S) + 1                      # the epochs up to the first new period's end
    np.testing.assert_array_equal(before.mass[:upto], after.mass[:upto])
    assert not np.array_equal(before.mass, after.mass)


def test_a_pooled_ladder_simulates_and_a_weight_of_zero_is_the_plain_ladder() -> None:
    rng = np.random.default_rng(5)
    apps = [_app(f"app{i}", sorted(rng.uniform(0, 7200, n).tolist())) for i, n in enumerate((3, 5, 400, 40))]
    trace = Trace("tiny", "test", 7200.0, apps)
    costs = RungCosts()
    plain = simulate(trace, LadderPolicy(zygote_share=2.0), costs, runtimes=2)
    zero = simulate(trace, LadderPolicy(zygote_share=2.0, pooled_weight=0.0), costs, runtimes=2)
    pooled = simulate(trace, LadderPolicy(zygote_share=2.0, pooled_weight=1.0), costs, runtimes=2)
    np.testing.assert_array_equal(plain.starts, zero.starts)
    assert pooled.invocations == plain.invocations == sum(a.invocations for a in apps)
    assert pooled.starts.sum() == plain.starts.sum()
