"""The warm-pool LP on instances with known optima."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from ember.core.planner import ModelDemand, SliceProfile, plan_buffer
from ember.errors import InvalidInput

SMALL = SliceProfile("1g", capacity=2, idle_cost=1.0)
BIG = SliceProfile("7g", capacity=1, idle_cost=2.5)


def exactly(n: int) -> tuple[float, ...]:
    """P(D > j) for a demand of exactly n instances."""
    return (1.0,) * n


def test_known_optimum() -> None:
    # A needs 4 instances (2 per cold start): one 7g slice (serves 4) costs 2.5, two 1g slices
    # cost 2 but leave 2 cold starts (4 more). B needs 1 at 0.5 per cold start: a 1g slice (1.0)
    # is not worth it. Optimum 2.5 + 0.5 = 3.0 with A on the 7g slice.
    demands = [ModelDemand("A", 4, {"1g": 1, "7g": 4}, 2.0, exceed=exactly(4)),
               ModelDemand("B", 1, {"1g": 1}, 0.5, exceed=exactly(1))]
    plan = plan_buffer(demands, [SMALL, BIG])
    assert plan.objective == pytest.approx(3.0)
    assert plan.warm["A"] == pytest.approx({"7g": 1.0})
    assert plan.warm["B"] == {}
    assert plan.rounded == {"A": {"7g": 1}, "B": {}}
    assert plan.expected_cold_starts == pytest.approx(1.0)
    assert plan.idle_cost == pytest.approx(2.5)


def test_capacity_binds() -> None:
    # Without the 7g slice A takes both 1g slices (2 + 2 x 2 cold) and B stays cold: 6.5.
    demands = [ModelDemand("A", 4, {"1g": 1, "7g": 4}, 2.0, exceed=exactly(4)),
               ModelDemand("B", 1, {"1g": 1}, 0.5, exceed=exactly(1))]
    plan = plan_buffer(demands, [SMALL, SliceProfile("7g", 0, 2.5)])
    assert plan.objective == pytest.approx(6.5)
    assert plan.warm["A"] == pytest.approx({"1g": 2.0})
    assert plan.expected_cold_starts == pytest.approx(3.0)


def test_poisson_demand_matches_brute_force() -> None:
    # One model, Poisson(3) demand, cold start worth 4, slices of 1 instance at 1.0: the best
    # integer pool minimises 4 * E[(D - c)^+] + c; the LP finds the same value.
    lam, cost = 3.0, 4.0
    demand = ModelDemand("m", lam, {"cpu": 1.0}, cost)
    plan = plan_buffer([demand], [SliceProfile("cpu", 50, 1.0)])
    j = np.arange(200)
    pmf = np.exp(-lam + j * math.log(lam) - np.array([math.lgamma(x + 1) for x in j]))
    best = min(cost * float((np.maximum(j - c, 0) * pmf).sum()) + c for c in range(20))
    assert plan.objective == pytest.approx(best, rel=1e-6)


def test_brute_force_on_a_two_profile_grid() -> None:
    profiles = [SliceProfile("a", 3, 1.0), SliceProfile("b", 2, 1.6)]
    demands = [ModelDemand("x", 2.0, {"a": 1, "b": 2}, 3.0), ModelDemand("y", 1.0, {"a": 1, "b": 2}, 1.5)]
    plan = plan_buffer(demands, profiles)
    tails = [d.tail() for d in demands]

    def cost(alloc: tuple[int, ...]) -> float:
        xa, xb, ya, yb = alloc
        if xa + ya > 3 or xb + yb > 2:
            return math.inf
        total = xa + ya + 1.6 * (xb + yb)
        for d, t, cover in zip(demands, tails, (xa + 2 * xb, ya + 2 * yb), strict=True):
            total += d.cold_start_cost * float(t[cover:].sum())
        return total

    best = min(cost(a) for a in itertools.product(range(4), range(3), range(4), range(3)))
    assert plan.objective <= best + 1e-6                 # the LP relaxes the integer problem
    rounded = plan.rounded
    alloc = (rounded["x"].get("a", 0), rounded["x"].get("b", 0), rounded["y"].get("a", 0), rounded["y"].get("b", 0))
    assert cost(alloc) < math.inf                        # the rounded plan respects capacity


def test_thousand_models_six_profiles_solve() -> None:
    rng = np.random.default_rng(0)
    per = {"mig-1g": 1, "mig-2g": 2, "mig-3g": 3, "mig-4g": 4, "mig-7g": 7, "cpu": 0.5}
    profiles = [SliceProfile(n, 300, c) for n, c in zip(per, (1.0, 1.9, 2.8, 3.6, 6.0, 0.3), strict=True)]
    demands = [ModelDemand(f"m{i}", float(10 ** rng.uniform(-2, 1.3)), per, float(rng.uniform(0.5, 5)))
               for i in range(1000)]
    plan = plan_buffer(demands, profiles)
    assert plan.status == "optimal"
    for p in profiles:
        assert sum(w.get(p.name, 0.0) for w in plan.warm.values()) <= p.capacity + 1e-6
        assert sum(r.get(p.name, 0) for r in plan.rounded.values()) <= p.capacity


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: SliceProfile("x", -1, 1.0), "capacity"),
        (lambda: SliceProfile("x", 1, float("inf")), "idle_cost"),
        (lambda: ModelDemand("m", -1.0, {}), "expected"),
        (lambda: ModelDemand("m", 1.0, {"x": -2}), "per_slice"),
        (lambda: ModelDemand("m", 1.0, {}, exceed=(0.5, 0.9)), "exceed"),
        (lambda: plan_buffer([ModelDemand("m", 1.0, {"nope": 1})], [SMALL]), "nope"),
        (lambda: plan_buffer([], [SMALL, SMALL]), "unique"),
    ],
)
def test_bad_input_names_the_field(build: object, field: str) -> None:
    with pytest.raises(InvalidInput, match=field):
        build()  # type: ignore[operator]


def test_profiles_from_slices_per_node() -> None:
    from ember.core.planner import on_nodes

    profile = on_nodes("mig-1g", per_node=7, nodes=2, idle_cost=1.0)
    assert profile.capacity == 14
    plan = plan_buffer([ModelDemand("m", 20, {"mig-1g": 1}, 10.0, exceed=exactly(20))], [profile])
    assert plan.warm["m"] == pytest.approx({"mig-1g": 14.0})
    with pytest.raises(InvalidInput, match="per_node"):
        on_nodes("x", per_node=-1, nodes=2, idle_cost=1.0)
