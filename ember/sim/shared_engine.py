"""The shared-node simulator: every application's instance on one node's memory, evicting each other.

The per-application engine (`ember.sim.engine`) gives each application its idle capacity
on its own. Memory-budget policies (FaaSCache) need the applications to compete: here one
event-driven pass walks all applications' arrival groups in time order over a node whose
instances share `budget_mb`.

The model follows the live node (`ember.core.scheduler.place`, `_victim`):
- one instance per application, as in the per-application engine; it is busy (not
  evictable) from a group's first arrival to the latest end of any execution so far,
  including the sub-minute gaps between a group's arrivals (charged as idle hot time, as
  the per-application engine does, but not open to eviction: an approximation for the
  per-minute 2019 groups, exact for per-invocation traces);
- an arrival that finds its instance busy or idle is a hot start; one that finds it
  evicted starts it from the runtime's zygote, which the live server keeps whatever the
  policy (the parity FixedZygote and HybridZygote have); an application's first arrival is
  a compulsory cold start from nothing, with nothing charged before it;
- a start needs one instance's memory (`RungCosts.hot.idle_mb`); while it does not fit,
  the idle instance of least priority (`policy.priority`) is evicted, another model's only,
  as the live scheduler evicts; if every other instance is busy the start goes ahead over
  budget and is counted (`RunResult.over_budget`);
- an evicted instance's application sits on the zygote from the eviction to its next
  arrival (or the end of the trace); zygotes are charged per runtime as in the
  per-application engine, outside the budget;
- with `LpBuffer` (lp-buffer) a planner also sizes the idle instances every period
  (`ember.sim.warm_pool_sim`): the covered stay or are loaded from the zygote, the rest
  drop to it, and between plans the least likely to be used is evicted first. A load takes a
  zygote start's time less a hot start's (charged from its beginning); an arrival before it is
  done is counted as a zygote start, as the per-application engine counts one during a climb.

Metrics are the per-application engine's (`RunResult`): starts per rung, idle seconds per
rung, per-app cold shares, so both engines' runs share the tables, JSON and frontiers.
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from ember.core.rung_costs import RungCosts
from ember.keepalive.idle_plan import COLD, HOT, ZYGOTE
from ember.sim.engine import RunResult, group_spans
from ember.sim.greedy_dual import FaaSCache, LpBuffer
from ember.sim.traces import Trace
from ember.sim.warm_pool_sim import PoolPlanner
from ember.sim.zygotes import Holding

_NEVER, _BUSY, _IDLE, _GONE = range(4)


def _within_idle(trace: Trace) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per app: the latest end through each group, and the idle seconds between a group's own arrivals."""
    out = []
    for app in trace.apps:
        latest, busy, partial, partial_gap = group_spans(app)
        regular = app.counts - 1 - busy - partial
        idle = partial * np.maximum(partial_gap, 0.0) + regular * np.maximum(app.spacing - app.durations, 0.0)
        out.append((latest, idle))
    return out


class _Node:
    """The node's state during one pass: per app its state and clocks, the idle heap, the memory in use."""

    NEVER, BUSY, IDLE, GONE = _NEVER, _BUSY, _IDLE, _GONE

    def __init__(self, apps: int, policy: FaaSCache, costs: RungCosts) -> None:
        self.policy, self.costs = policy, costs
        self.size = costs.hot.idle_mb
        self.state = [_NEVER] * apps
        self.since = [0.0] * apps        # idle since (IDLE), evicted at (GONE)
        self.busy_until = [0.0] * apps
        self.ready = [0.0] * apps        # when a pre-warm loading the instance back from the zygote is done
        # A load from the zygote takes what a zygote start does beyond a hot one (the per-application engine's climb).
        self.load_s = max(0.0, costs.zygote.start_s - costs.hot.start_s)
        self.freq = [0] * apps
        self.version = [0] * apps        # invalidates stale heap entries
        self.idle: list[tuple[float, float, int, int]] = []   # (priority, idle since, app, version)
        self.ends: list[tuple[float, int, int]] = []          # (busy until, app, version)
        self.used = 0.0
        self.clock = 0.0
        self.over_budget = 0
        self.hot_idle = np.zeros(apps)
        self.zygote_idle = np.zeros(apps)
        # Each app's last execution's end, and its hot idle seconds from then on (the trailing period's).
        self.last_end = np.full(apps, np.inf)
        self.tail_hot = np.zeros(apps)
        self.score: np.ndarray | None = None     # a planner's eviction priority per app (lp-buffer)

    def settle(self, now: float) -> None:
        """Instances whose executions ended by `now` go idle, with their priority."""
        ends, state = self.ends, self.state
        while ends and ends[0][0] <= now:
            at, a, ver = heapq.heappop(ends)
            if state[a] == _BUSY and self.version[a] == ver:
                state[a] = _IDLE
                self.since[a] = at
                if self.score is not None:
                    prio = float(self.score[a])
                else:
                    prio = self.policy.priority(self.clock, self.freq[a], at, self.costs)
                heapq.heappush(self.idle, (prio, at, a, ver))

    def make_room(self, now: float) -> None:
        """Evict the least-priority idle instances until one more instance fits (or none is left)."""
        budget = self.policy.budget_mb
        while self.used + self.size > budget + 1e-9:
            victim = self._pop_idle()
            if victim is None:
                self.over_budget += 1
                return
            prio, a = victim
            self.drop(a, now)
            self.clock = max(self.clock, prio)

    def drop(self, a: int, now: float) -> None:
        """Evict app a's idle instance: it drops to the zygote."""
        self.hot_idle[a] += now - self.since[a]
        if self.since[a] >= self.last_end[a]:
            self.tail_hot[a] += now - self.since[a]
        self.state[a] = _GONE
        self.since[a] = now
        self.freq[a] = 0
        self.version[a] += 1
        self.used -= self.size

    def keep(self, a: int, now: float, priority: float) -> int:
        """Keep app a's instance idle and warm with this eviction priority, loading it from the zygote if it
        was evicted; 1 if it was (a pre-warm)."""
        loaded = self.state[a] == _GONE
        if loaded:
            self.zygote_idle[a] += now - self.since[a]
            self.state[a] = _IDLE
            self.since[a] = now
            self.ready[a] = now + self.load_s
            self.used += self.size
        self.version[a] += 1
        heapq.heappush(self.idle, (priority, self.since[a], a, self.version[a]))
        return int(loaded)

    def _pop_idle(self) -> tuple[float, int] | None:
        while self.idle:
            prio, _, a, ver = heapq.heappop(self.idle)
            if self.state[a] == _IDLE and self.version[a] == ver:
                return prio, a
        return None

    def arrive(self, a: int, now: float, until: float, k: int) -> int:
        """A group of k arrivals of app a from `now`, busy until `until`; the level its first arrival starts from."""
        state = self.state[a]
        if state == _BUSY:
            level = HOT
        elif state == _IDLE:
            level = HOT if now >= self.ready[a] else ZYGOTE     # (during a pre-warm's load: it waits for it)
            self.ready[a] = 0.0      # one start waits for a load: the next is the next idle period's (as per app)
            self.hot_idle[a] += now - self.since[a]
        else:
            level = COLD if state == _NEVER else ZYGOTE
            if state == _GONE:
                self.zygote_idle[a] += now - self.since[a]
            self.make_room(now)
            self.used += self.size
        self.state[a] = _BUSY
        self.version[a] += 1
        self.freq[a] += k
        self.busy_until[a] = max(self.busy_until[a], until)
        heapq.heappush(self.ends, (self.busy_until[a], a, self.version[a]))
        return level

    def close(self, horizon: float) -> None:
        self.settle(np.inf)
        for a, state in enumerate(self.state):
            if state == _IDLE:
                self.hot_idle[a] += max(0.0, horizon - self.since[a])
                if self.since[a] >= self.last_end[a]:
                    self.tail_hot[a] += max(0.0, horizon - self.since[a])
            elif state == _GONE:
                self.zygote_idle[a] += max(0.0, horizon - self.since[a])


def simulate_shared(trace: Trace, policy: FaaSCache, costs: RungCosts, *, runtimes: int = 1,
                    per_app: bool = False) -> RunResult:
    """Run the memory-budget `policy` over all of `trace`'s applications on one node. `per_app`: keep each
    application's starts and idle seconds per level in `RunResult.apps`, with its hold on the zygote (from its first
    start on, never let go) and its trailing period's hot idle seconds (`Holding.tail_s`)."""
    began = time.perf_counter()
    spans = _within_idle(trace)
    n = len(trace.apps)
    app_of = np.concatenate([np.full(len(a.starts), i, dtype=np.int64) for i, a in enumerate(trace.apps)] or
                            [np.zeros(0, dtype=np.int64)])
    group_of = np.concatenate([np.arange(len(a.starts)) for a in trace.apps] or [np.zeros(0, dtype=np.int64)])
    t_all = np.concatenate([a.starts for a in trace.apps] or [np.zeros(0)])
    order = np.lexsort((app_of, t_all))
    node = _Node(n, policy, costs)
    for a, (latest, _) in enumerate(spans):
        if len(latest):
            node.last_end[a] = float(latest[-1])
    planner = PoolPlanner(trace, policy, costs) if isinstance(policy, LpBuffer) else None
    if planner is not None:
        node.score = planner.score
    starts = np.zeros((n, 5))
    within_hot = np.zeros(n)
    for a, g, t in zip(app_of[order].tolist(), group_of[order].tolist(), t_all[order].tolist(), strict=True):
        if planner is not None:
            planner.until(node, t)
        node.settle(t)
        latest, idle = spans[a]
        k = int(trace.apps[a].counts[g])
        level = node.arrive(a, t, float(latest[g]), k)
        starts[a, level] += 1
        starts[a, HOT] += k - 1
        within_hot[a] += idle[g]
    if planner is not None:
        planner.until(node, trace.horizon_s)
    node.close(trace.horizon_s)
    result = _result(trace, policy, costs, runtimes, starts, node, within_hot, began)
    if planner is not None:
        result.prewarms, result.plans, result.lp_solves = planner.prewarms, planner.plans, planner.solves
    if per_app:
        for a, app in enumerate(trace.apps):
            if app.invocations:
                idle = np.zeros(5)
                idle[HOT], idle[ZYGOTE] = node.hot_idle[a] + within_hot[a], node.zygote_idle[a]
                tail = np.zeros(5)
                tail[HOT] = node.tail_hot[a]
                result.apps[a] = (starts[a].copy(), idle, Holding(float(app.starts[0]), np.zeros(0), np.zeros(0),
                                                                   tail_s=tail))
    return result


def _result(trace: Trace, policy: FaaSCache, costs: RungCosts, runtimes: int, starts: np.ndarray, node: _Node,
            within_hot: np.ndarray, began: float) -> RunResult:
    result = RunResult(policy.name, policy.knob, policy.knob_value())
    invocations = np.array([a.invocations for a in trace.apps], dtype=np.float64)
    result.invocations = int(invocations.sum())
    result.starts = starts.sum(axis=0)
    result.idle_s[HOT] = float(node.hot_idle.sum() + within_hot.sum())
    result.idle_s[ZYGOTE] = float(node.zygote_idle.sum())
    active = invocations > 0
    result.app_cold = starts[active, 2:].sum(axis=1) / invocations[active]
    result.idle_mb_s = result.idle_s * costs.own_mb()
    # Nothing is ever dropped below the zygote, which the live node keeps while any model of its runtime holds
    # it (ember.sim.zygotes): each runtime's is up from its first start to the end.
    first = np.full(runtimes, trace.horizon_s)
    for i, a in enumerate(trace.apps):
        if a.invocations:
            first[i % runtimes] = min(first[i % runtimes], float(a.starts[0]))
    result.shared_mb_s = float(np.maximum(trace.horizon_s - first, 0.0).sum()) * costs.zygote.idle_mb
    result.over_budget = node.over_budget
    result.wall_s = time.perf_counter() - began
    return result


__all__ = ["simulate_shared"]
