"""The warm pool sized by the LP buffer planner: hand-solved cases."""

from __future__ import annotations

import pytest

from ember.core.warm_pool import PoolDemand, plan_pool
from ember.errors import InvalidInput
from ember.sim.greedy_dual import LpBuffer

# A start from the floor costs 100 s more than a hot one, valued at 1e3 MB*s per second: a covered instance saves
# P(needed) * 1e5 MB*s; over a 60 s period an idle instance of 100 MB costs 6,000 MB*s, one of 200 MB 12,000.
SAVED_S, VALUE, PERIOD = 100.0, 1e3, 60.0
X = PoolDemand("x", (0.9, 0.5, 0.05), 100.0, SAVED_S)    # the third instance saves 5,000 < 6,000: never worth it
Y = PoolDemand("y", (0.7,), 200.0, SAVED_S)


def test_a_budget_that_does_not_bind_keeps_every_instance_worth_its_memory() -> None:
    plan = plan_pool([X, Y], 1e4, PERIOD, VALUE)
    assert plan.counts == {"x": 2, "y": 1} and not plan.solved


def test_under_a_binding_budget_the_best_saving_per_megabyte_goes_first() -> None:
    # Per MB: x's first instance (90,000 - 6,000) / 100 = 840, its second 440, y's (70,000 - 12,000) / 200 = 290.
    # 250 MB: both of x's (200 MB); the LP gives y the last 50 MB (a quarter instance), which is floored away.
    assert plan_pool([X, Y], 250.0, PERIOD, VALUE).counts == {"x": 2}
    # 150 MB: x's first only.
    assert plan_pool([Y, X], 150.0, PERIOD, VALUE).counts == {"x": 1}


def test_nothing_is_kept_that_does_not_pay_or_does_not_fit() -> None:
    assert plan_pool([X, Y], 99.0, PERIOD, VALUE).counts == {}
    assert plan_pool([PoolDemand("z", (0.05,), 100.0, SAVED_S)], 1e4, PERIOD, VALUE).counts == {}
    assert plan_pool([], 1e4, PERIOD, VALUE).counts == {}


def test_ties_split_by_the_lp_still_fill_the_budget() -> None:
    # Two equal models and room for one: the LP may split half and half; the plan keeps one whole instance.
    a, b = PoolDemand("a", (0.9,), 100.0, SAVED_S), PoolDemand("b", (0.9,), 100.0, SAVED_S)
    got = plan_pool([a, b], 150.0, PERIOD, VALUE)
    assert sum(got.counts.values()) == 1 and got.solved


def test_knobs_are_validated_naming_the_knob_and_its_range() -> None:
    with pytest.raises(InvalidInput, match=r"latency_value must lie in \[0.001"):
        LpBuffer(latency_value=0.0)
    with pytest.raises(InvalidInput, match=r"period_s must lie in \[1, 86400\]"):
        LpBuffer(period_s=0.5)
    with pytest.raises(InvalidInput, match="budget_gb"):
        LpBuffer(budget_gb=0.0)

