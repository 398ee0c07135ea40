"""Runs policies (at their defaults and across their knob sweeps) over one trace and compares them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ember.core.rung_costs import RungCosts
from ember.errors import InvalidInput
from ember.keepalive.idle_plan import KeepAlivePolicy, typed_knobs
from ember.keepalive.policies import POLICIES, LadderPolicy
from ember.keepalive.preset import Preset
from ember.sim.engine import RunResult, app_items, simulate
from ember.sim.greedy_dual import FaaSCache, LpBuffer, LruEvict
from ember.sim.keepalive_layered import RainbowCake
from ember.sim.shared_engine import simulate_shared
from ember.sim.traces import Trace

# Every policy the simulator runs: the live server's (POLICIES), the layered baseline, and the memory-budget
# policies that need the shared-node engine.
SIM_POLICIES: dict[str, type] = {**POLICIES, "rainbowcake": RainbowCake, "faascache": FaaSCache,
                                 "lru-evict": LruEvict, "lp-buffer": LpBuffer}
SimPolicy = KeepAlivePolicy | FaaSCache
# The most runtimes apps may be spread over (ember has 2): the engine keeps per-runtime arrays of the trace's span.
MAX_RUNTIMES = 10_000


@dataclass
class PolicySweep:
    name: str
    knob: str
    default: RunResult
    sweep: list[RunResult] = field(default_factory=list)

    def points(self) -> list[RunResult]:
        seen = {r.knob_value: r for r in [*self.sweep, self.default]}
        return sorted(seen.values(), key=lambda r: r.total_idle_mb_s)

    def frontier(self, metric: str = "cold_start_rate", costs: RungCosts | None = None) -> list[RunResult]:
        """Pareto-optimal points: none has both less idle memory and a lower metric."""
        out: list[RunResult] = []
        best = float("inf")
        for r in self.points():
            v = _metric(r, metric, costs)
            if v < best - 1e-15:
                out.append(r)
                best = v
        return out


def _metric(r: RunResult, metric: str, costs: RungCosts | None) -> float:
    if metric == "cold_start_rate":
        return r.cold_start_rate
    if metric == "latency_mean":
        return r.latency_mean(costs or RungCosts())
    raise InvalidInput(f"unknown metric {metric!r}")


def build_policies(names: list[str], knobs: dict[str, dict[str, Any]], costs: RungCosts,
                   zygote_share: float, preset: Preset | None = None) -> list[SimPolicy]:
    """The named policies with their knobs; the ladder's (and ladder-cold's) constants from `preset` (None: the
    class's defaults), the knobs on top: `ember sim` passes the preset `ember serve` runs."""
    unknown = [n for n in [*names, *knobs] if n not in SIM_POLICIES]
    if unknown:
        raise InvalidInput(f"--policies: unknown policy {unknown[0]!r} (known: {', '.join(SIM_POLICIES)})")
    # Every policy given knobs is built, run or not (a typo in a knob of another policy is still a typo), and every
    # point of each one's sweep, so that bad knobs fail here, not after the first runs.
    built = {name: _build(name, knobs.get(name, {}), costs, zygote_share, preset)
             for name in dict.fromkeys([*names, *knobs])}
    return [built[name] for name in names]


def _build(name: str, knobs: dict[str, Any], costs: RungCosts, zygote_share: float,
           preset: Preset | None = None) -> SimPolicy:
    extra: dict[str, Any] = typed_knobs(name, SIM_POLICIES[name], knobs)
    if name in ("ladder", "ladder-cold", "rainbowcake"):
        extra = {"costs": costs, "zygote_share": max(1.0, zygote_share), **extra}
    policy: SimPolicy
    if preset is not None and name in ("ladder", "ladder-cold"):
        policy = preset.ladder(cold=name == "ladder-cold", **extra)
    else:
        policy = SIM_POLICIES[name](**extra)
    for value in policy.sweep():
        try:
            policy.with_knob(value)
        except InvalidInput as err:
            raise InvalidInput(f"{err.message} (its sweep's {policy.knob} {value:g}, with these knobs)") from None
    return policy


def run_one(trace: Trace, policy: SimPolicy, costs: RungCosts, *, runtimes: int = 1,
            items: list[Any] | None = None) -> RunResult:
    """One policy at one knob value: memory-budget policies on the shared node, the others per application."""
    if isinstance(policy, FaaSCache):
        return simulate_shared(trace, policy, costs, runtimes=runtimes)
    return simulate(trace, policy, costs, runtimes=runtimes, items=items)


def run_policies(trace: Trace, policies: list[SimPolicy], costs: RungCosts, *, runtimes: int = 1,
                 sweep: bool = True) -> list[PolicySweep]:
    """Each policy at its configured knob, then (with `sweep`) at each value of its knob's sweep."""
    if not 1 <= runtimes <= MAX_RUNTIMES:
        raise InvalidInput(f"--runtimes must lie in [1, {MAX_RUNTIMES:,}], got {runtimes}")
    items = [app_items(a, trace.horizon_s) for a in trace.apps]
    out = []
    for policy in policies:
        default = run_one(trace, policy, costs, runtimes=runtimes, items=items)
        runs = []
        if sweep:
            for value in policy.sweep():
                if np.isclose(value, policy.knob_value()):
                    continue
                runs.append(run_one(trace, policy.with_knob(value), costs, runtimes=runtimes, items=items))
        out.append(PolicySweep(policy.name, policy.knob, default, runs))
    return out


def compare(ladder: PolicySweep, other: PolicySweep, costs: RungCosts) -> list[dict[str, float | bool | None]]:
    """Per point of `other`: the ladder's best latency at no more idle memory, and its least memory at no
    more mean latency."""
    rows: list[dict[str, float | bool | None]] = []
    lad = ladder.points()
    for o in other.points():
        cheaper = [r for r in lad if r.total_idle_mb_s <= o.total_idle_mb_s * (1 + 1e-9)]
        fast = min(cheaper, key=lambda r: (r.latency_mean(costs), r.latency_quantile(costs, 0.99)), default=None)
        quicker = [r for r in lad if r.latency_mean(costs) <= o.latency_mean(costs)]
        lean = min(quicker, key=lambda r: r.total_idle_mb_s, default=None)
        rows.append({
            "knob_value": o.knob_value,
            "idle_mb_s": o.total_idle_mb_s,
            "latency_mean_s": o.latency_mean(costs),
            "latency_p99_s": o.latency_quantile(costs, 0.99),
            "ladder_latency_mean_s": fast.latency_mean(costs) if fast else None,
            "ladder_latency_p99_s": fast.latency_quantile(costs, 0.99) if fast else None,
            "ladder_idle_mb_s_same_latency": lean.total_idle_mb_s if lean else None,
            "ladder_wins_same_memory": bool(fast and fast.latency_mean(costs) < o.latency_mean(costs)
                                            and fast.latency_quantile(costs, 0.99) <= o.latency_quantile(costs, 0.99)),
            "ladder_wins_same_latency": bool(lean and lean.total_idle_mb_s < o.total_idle_mb_s),
        })
    return rows


def ladder_share(trace: Trace, runtimes: int) -> float:
    """Models per runtime: how many share one zygote."""
    return max(1.0, len(trace.apps) / max(1, runtimes))


def with_costs(policy: KeepAlivePolicy, costs: RungCosts) -> KeepAlivePolicy:
    return replace(policy, costs=costs) if isinstance(policy, LadderPolicy | RainbowCake) else policy
