"""The LP warm pool on the shared-node simulator: every planning period, the buffer planner decides which idle
instances the node keeps.

At each multiple of `LpBuffer.period_s` (through the whole trace, also after the last
arrival) the planner:
- adds to each application's idle-time statistics the idle periods that ended by then (an
  idle period is known once the arrival that ends it has happened: no peeking), the same
  statistics the ladder keeps (`HistogramSpec` with head cells);
- turns them into the ladder's forecast (`LadderPolicy.hazards`: the per-cell chance of an
  arrival given idle at the cell's start, prior-smoothed, with an exponential tail) and from it
  each idle or evicted application's chance of an arrival in the coming period given how long
  it has been idle (constant hazard within a cell);
- sizes the pool with `plan_pool` under what the busy instances leave of the budget;
- keeps the covered idle instances, loads the covered evicted ones from the zygote (a
  pre-warm, timed as the per-application engine times the ladder's climbs: an arrival before
  it is done is a zygote start) and drops the uncovered idle ones to the zygote, FaaSCache's
  floor (parity).
Between plans an instance that goes idle stays; a start that needs room evicts the idle
instance with the least chance of an arrival within a period of going idle (from the last plan's
statistics).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ember.core.rung_costs import RungCosts
from ember.core.warm_pool import PoolDemand, plan_pool
from ember.keepalive.arrivals import ArrivalForecast
from ember.keepalive.forecast import HistoryTable
from ember.keepalive.policies import LadderPolicy
from ember.sim.engine import group_spans
from ember.sim.greedy_dual import LpBuffer
from ember.sim.traces import Trace


class IdleStats:
    """Every application's idle-time statistics, advanced in time: the periods known by `t` only."""

    def __init__(self, trace: Trace, ladder: LadderPolicy) -> None:
        self.ladder, self.spec = ladder, ladder.spec
        self.known, self.app, self.gap, self.weight = _idle_periods(trace)
        self.bin = self.spec.bin_of(self.gap)
        self.head = self.spec.head_of(self.gap)
        n, h = len(trace.apps), self.spec.head_splits + 1
        self.counts = np.zeros((n, self.spec.n_bins + 1))        # the last column: out of bounds
        self.excess, self.sum_s = np.zeros(n), np.zeros(n)
        self.head_counts, self.head_sums = np.zeros((n, h)), np.zeros((n, h))
        self.pos = 0

    def advance(self, t: float) -> None:
        """Take in the idle periods known by t."""
        end = int(np.searchsorted(self.known, t, side="right"))
        s = slice(self.pos, end)
        if end > self.pos:
            a, b, w, g = self.app[s], self.bin[s], self.weight[s], self.gap[s]
            np.add.at(self.counts, (a, b), w)
            np.add.at(self.sum_s, a, g * w)
            np.add.at(self.excess, a, np.maximum(g - self.spec.range_s, 0.0) * w)
            first = b == 0
            np.add.at(self.head_counts, (a[first], self.head[s][first]), w[first])
            np.add.at(self.head_sums, (a[first], self.head[s][first]), (g * w)[first])
        self.pos = end

    def survival(self, rows: np.ndarray) -> ArrivalForecast:
        """The forecast of the given apps' idle periods (the ladder's hazards per cell)."""
        nb = self.spec.n_bins
        table = HistoryTable(self.spec, np.arange(nb), self.counts[rows, :nb], self.counts[rows, nb],
                             self.sum_s[rows], self.excess[rows], self.head_counts[rows], self.head_sums[rows])
        return ArrivalForecast(self.ladder, table)


def _idle_periods(trace: Trace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every idle period of every app, in the order they become known: (known at, app, idle seconds, weight).

    As the per-application engine's items (`ember.sim.engine.app_items`): a group's own gaps are known at its
    last arrival, the gap to the next group at that group's start."""
    apps, gaps, weights, known = [], [], [], []
    for i, a in enumerate(trace.apps):
        if not len(a.starts):
            continue
        latest, busy, partial, partial_gap = group_spans(a)
        last = a.starts + (a.counts - 1) * a.spacing
        to_next = np.append(a.starts[1:] - latest[:-1], 0.0)     # the last group has no next one: weight 0
        for g_, w_, at in ((np.zeros(len(busy)), busy, last), (partial_gap, partial, last),
                           (a.spacing - a.durations, a.counts - 1 - busy - partial, last),
                           (to_next, np.append(np.ones(len(to_next) - 1), 0.0), np.append(a.starts[1:], np.inf))):
            apps.append(np.full(len(w_), i))
            gaps.append(g_)
            weights.append(w_)
            known.append(at)
    if not apps:
        return np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0)
    w = np.concatenate(weights).astype(np.float64)
    keep = w > 0
    at = np.concatenate(known)[keep]
    order = np.argsort(at, kind="stable")
    return (at[order], np.concatenate(apps)[keep][order], np.maximum(np.concatenate(gaps)[keep][order], 0.0),
            w[keep][order])


class PoolPlanner:
    """Plans the shared node's idle instances at every period boundary (see the module docstring)."""

    def __init__(self, trace: Trace, policy: LpBuffer, costs: RungCosts) -> None:
        self.policy, self.costs = policy, costs
        self.stats = IdleStats(trace, LadderPolicy(costs=costs))
        self.next_at = policy.period_s
        self.score = np.zeros(len(trace.apps))      # chance of an arrival within a period of going idle
        self.prewarms = 0
        self.plans = 0
        self.solves = 0       # plans where the budget bound and the LP was solved

    def until(self, node: _NodeLike, t: float) -> None:
        """Run every plan due at or before t."""
        while self.next_at <= t:
            node.settle(self.next_at)
            self.plan(node, self.next_at)
            self.next_at += self.policy.period_s

    def plan(self, node: _NodeLike, now: float) -> None:
        self.plans += 1
        self.stats.advance(now)
        state = np.asarray(node.state)
        seen = np.flatnonzero(state != node.NEVER)
        if not len(seen):
            return
        period = self.policy.period_s
        forecast = self.stats.survival(seen)
        self.score[seen] = forecast.chance(np.arange(len(seen)), np.zeros(len(seen)), period)
        at = np.flatnonzero((state[seen] == node.IDLE) | (state[seen] == node.GONE))
        open_ = seen[at]
        p = forecast.chance(at, now - np.asarray(node.busy_until)[open_], period)
        busy_mb = float((state == node.BUSY).sum()) * node.size
        saved = self.policy.start_saved_s(self.costs)
        demands = [PoolDemand(str(a), (float(q),), node.size, saved) for a, q in zip(open_, p, strict=True)]
        pool = plan_pool(demands, max(0.0, self.policy.budget_mb - busy_mb), period, self.policy.latency_value)
        self.solves += pool.solved
        keep = pool.counts
        for a, q in zip(open_.tolist(), p.tolist(), strict=True):
            if str(a) in keep:
                self.prewarms += node.keep(a, now, q)
            elif state[a] == node.IDLE:
                node.drop(a, now)


class _NodeLike(Protocol):
    """What the planner needs of the shared engine's node (`ember.sim.shared_engine._Node`)."""

    NEVER: int
    BUSY: int
    IDLE: int
    GONE: int
    state: list[int]
    busy_until: list[float]
    size: float

    def settle(self, now: float) -> None: ...
    def keep(self, a: int, now: float, priority: float) -> int: ...
    def drop(self, a: int, now: float) -> None: ...


__all__ = ["IdleStats", "PoolPlanner"]
