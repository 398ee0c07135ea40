"""The warm pool, live: how many idle instances each model keeps under the node's idle-memory budget.

With `ember serve --idle-memory-mb N`, every `replan_s` (1 s) the actuator asks the pool for a
plan: per model, a forecast of how many instances it will need in the coming `period_s`
(60 s), and the LP buffer planner (`ember.core.warm_pool.plan_pool`, GLOP) chooses how many
idle instances each keeps, at most N MB of them. The actuator then recycles the idle
instances beyond that count (the least recently used first; never below the contract's
min scale); the kept ones are paused by the lifecycle as before. Busy instances are not idle
capacity: they are outside the budget.

The forecast, per model: the chance p of a request within the period given how long the
model has been idle, from its idle history by the forecast the server wires in (the ladder's,
`ember.keepalive.arrivals.LadderForecast`, as the simulator's lp-buffer policy), and a count:
P(D > j) = p for j below the most instances the model has had in use at once over the last hour
(at least one), 0 beyond. The instances in use
now cover the first ones, so the idle pool is sized for P(D > busy + j). An instance saves
the start its model's next request would otherwise need (from the template, the zygote or a
fetch, by `RungCosts`) less a hot start, valued at `latency_value` MB*s per second.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from ember.core.lifecycle import Action, Recycle
from ember.core.pool import Instance, Snapshot
from ember.core.states import InstanceState
from ember.core.warm_pool import PoolDemand, WarmPoolSettings, plan_pool
from ember.keepalive.forecast import IdleHistory
from ember.keepalive.idle_plan import LEVELS
from ember.serving.ports import IdleForecast

log = logging.getLogger("ember.controller")

_IDLE = (InstanceState.IDLE, InstanceState.PAUSED, InstanceState.ASLEEP)
_IN_USE = (InstanceState.BUSY, InstanceState.STARTING)


class ModelView(Protocol):
    """What the pool reads of a deployment (`ember.serving.deployments.Deployment`)."""

    @property
    def history(self) -> IdleHistory | None: ...
    @property
    def last_done(self) -> float | None: ...


class WarmPool:
    def __init__(self, settings: WarmPoolSettings, forecast: IdleForecast) -> None:
        self.settings, self._forecast = settings, forecast
        self._peaks: dict[str, deque[tuple[float, int]]] = {}    # per model: (minute, most in use in it)
        self._plan_at = float("-inf")
        self.counts: dict[str, int] = {}       # the last plan: idle instances each model keeps

    def adjust(self, snapshot: Snapshot, now: float, models: Mapping[str, ModelView],
               actions: list[Action]) -> list[Action]:
        """The lifecycle's actions, plus the recycles that bring idle capacity within the plan (when one is due)."""
        self._sample(snapshot, now)
        if now < self._plan_at:
            return actions
        self._plan_at = now + self.settings.replan_s
        self.counts = self.plan(snapshot, now, models)
        return actions + self._trim(snapshot, now, actions)

    def plan(self, snapshot: Snapshot, now: float, models: Mapping[str, ModelView]) -> dict[str, int]:
        s = self.settings
        demands = []
        for key, info in snapshot.models.items():
            view = models.get(key)
            if view is None or view.last_done is None:
                continue   # never served: nothing to forecast from, and no idle instance to keep
            p = self.chance(view.history, now - view.last_done)
            busy = sum(1 for i in snapshot.of_model(key) if i.state in _IN_USE)
            exceed = tuple(p for _ in range(busy, self.peak(key)))
            saved = float(s.costs.start_s()[LEVELS.index(info.start_rung)]) - s.costs.hot.start_s
            demands.append(PoolDemand(key, exceed, float(info.memory_mb), max(saved, 0.0)))
        return plan_pool(demands, s.budget_mb, s.period_s, s.latency_value).counts

    def chance(self, history: IdleHistory | None, idle_s: float) -> float:
        """The chance of a request within the period, given idle for `idle_s` (the prior alone without history)."""
        return self._forecast.chance(history, idle_s, self.settings.period_s)

    def peak(self, key: str) -> int:
        """The most instances of `key` in use at once over the window (at least one)."""
        return max([1, *(n for _, n in self._peaks.get(key, ()))])

    def _sample(self, snapshot: Snapshot, now: float) -> None:
        """Remember the most instances in use per minute (a minute's bucket is kept for the window)."""
        minute = float(np.floor(now / 60.0))
        for key in snapshot.models:
            in_use = sum(1 for i in snapshot.of_model(key) if i.state in _IN_USE)
            seen = self._peaks.setdefault(key, deque())
            if seen and seen[-1][0] == minute:
                seen[-1] = (minute, max(seen[-1][1], in_use))
            elif in_use > 1:
                seen.append((minute, in_use))
            while seen and seen[0][0] * 60.0 < now - self.settings.peak_window_s:
                seen.popleft()

    def _trim(self, snapshot: Snapshot, now: float, actions: list[Action]) -> list[Action]:
        leaving = {a.instance_id for a in actions if isinstance(a, Recycle)}
        out: list[Action] = []
        for key, info in snapshot.models.items():
            mine = [i for i in snapshot.of_model(key) if i.id not in leaving]
            live = sum(1 for i in mine if i.state is not InstanceState.DRAINING)
            idle = sorted((i for i in mine if i.state in _IDLE), key=_recency)
            for inst in idle[self.counts.get(key, 0):]:
                if live <= info.min_scale:
                    break
                out.append(Recycle(inst.id, f"warm pool: idle {inst.idle_for(now):.0f}s, beyond the "
                                            f"{self.settings.budget_mb:g} MB idle-memory plan"))
                live -= 1
        return out


def _recency(inst: Instance) -> float:
    """Most recently idle first: those are the ones kept."""
    return -inst.since


__all__ = ["ModelView", "WarmPool"]
