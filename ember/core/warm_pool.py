"""The warm pool: how many idle instances each model keeps under a node memory budget, by the LP buffer planner.

Every planning period, each model has a forecast of how many instances it will need in
the coming period (`PoolDemand.exceed[j]` = P(D > j)); an idle warm instance costs its
memory for the period, and each instance the pool covers saves, with probability
P(D > j), a start from the floor (the runtime's zygote) instead of a hot start, valued at
`latency_value` MB*s per second of start latency (the ladder's knob, same meaning). The
budget is one slice profile, "memory", whose unit is a megabyte: capacity = the budget in
MB, idle cost of a unit = the period's seconds, and one unit serves 1 / size_mb of an
instance, so models of different sizes share one budget. `plan_buffer` (GLOP) solves it;
the fractional plan is floored to whole instances and what memory is left goes to the
largest remainders that fit. When every instance worth its memory fits, that is the LP's
optimum and it is not solved.

With one instance per model (the simulator), D is 0 or 1 and the LP reduces to ranking the
idle models by P(an arrival in the period) and keeping the best that are worth their
memory, as many as fit; the count distribution matters when models run several instances
(the live server's autoscaler).

The forecast comes from the keep-alive side (`ember.keepalive.arrivals.ArrivalForecast`, the ladder's). `LpBuffer`
is the policy as the shared-node simulator runs it (`ember.sim.warm_pool_sim`): a FaaSCache-like node (its knob is
the same `budget_gb`), planned every `period_s`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ember.core.planner import ModelDemand, SliceProfile, plan_buffer
from ember.core.rung_costs import RungCosts

_PROFILE = "memory"


@dataclass(frozen=True)
class PoolDemand:
    """One model's forecast for the coming period and what an instance of it costs and saves."""

    name: str
    exceed: tuple[float, ...]   # P(D > j): the chance it needs more than j instances at once in the period
    size_mb: float              # one idle instance's memory
    start_saved_s: float        # start latency one warm instance saves (the floor's start less a hot start)


@dataclass(frozen=True)
class PoolPlan:
    counts: dict[str, int]      # warm instances per model (absent: none)
    solved: bool                # whether the budget bound and the LP was solved


def plan_pool(demands: Sequence[PoolDemand], budget_mb: float, period_s: float, latency_value: float) -> PoolPlan:
    """Whole warm instances per model minimising expected valued start latency plus idle memory, within
    `budget_mb`."""
    wanted = {d.name: sum(p * latency_value * d.start_saved_s > d.size_mb * period_s for p in d.exceed)
              for d in demands if d.size_mb > 0}
    worth = [d for d in demands if wanted.get(d.name, 0) > 0]
    if not worth or budget_mb < min(d.size_mb for d in worth):
        return PoolPlan({}, False)
    if sum(wanted[d.name] * d.size_mb for d in worth) <= budget_mb:
        # The budget does not bind: the LP's optimum is every instance worth its memory; no need to solve it.
        return PoolPlan({d.name: wanted[d.name] for d in worth}, False)
    lp = [ModelDemand(d.name, 0.0, {_PROFILE: 1.0 / d.size_mb}, latency_value * d.start_saved_s,
                      exceed=tuple(d.exceed)) for d in worth]
    plan = plan_buffer(lp, [SliceProfile(_PROFILE, int(budget_mb), float(period_s))])
    covered = {d.name: plan.warm[d.name].get(_PROFILE, 0.0) / d.size_mb for d in worth}
    counts = {name: math.floor(c + 1e-6) for name, c in covered.items()}
    left = budget_mb - sum(counts[d.name] * d.size_mb for d in worth)
    # Flooring can leave room (two tied models at half an instance each): the largest remainders first.
    for d in sorted(worth, key=lambda d: covered[d.name] - counts[d.name], reverse=True):
        if covered[d.name] - counts[d.name] > 1e-6 and d.size_mb <= left + 1e-9:
            counts[d.name] += 1
            left -= d.size_mb
    return PoolPlan({name: n for name, n in counts.items() if n > 0}, True)


@dataclass(frozen=True)
class WarmPoolSettings:
    """The live warm pool's settings (`ember serve --idle-memory-mb`; `ember.serving.warmpool`)."""

    budget_mb: float                 # idle instances' memory on this node, all models together
    latency_value: float = 1e5       # MB*s of idle memory worth one second of start latency (the ladder's knob)
    period_s: float = 60.0           # the forecast's horizon
    replan_s: float = 1.0            # how often the plan is made and applied
    peak_window_s: float = 3600.0    # the most instances in use at once is remembered this long
    costs: RungCosts = field(default_factory=RungCosts)


__all__ = ["PoolDemand", "PoolPlan", "WarmPoolSettings", "plan_pool"]
