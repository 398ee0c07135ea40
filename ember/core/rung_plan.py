"""A keep-alive plan as the serving path reads it: the rung a model's idle capacity sits on per idle time.

A plain value: steps of (from which idle second, which rung), each held until the next begins. Keep-alive
policies (`ember.keepalive`) make these, the simulator evaluates them, and the core's lifecycle carries them
out (`ember.core.lifecycle`); the policies' array form of many plans is `ember.keepalive.idle_plan.PlanTable`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.core.states import Rung


@dataclass(frozen=True)
class IdlePlan:
    """Rung per idle time: `steps[i] = (from_s, rung)`, each held until the next step begins."""

    steps: tuple[tuple[float, Rung], ...]

    def rung_at(self, idle_s: float) -> Rung:
        current = self.steps[0][1]
        for start, rung in self.steps:
            if idle_s < start:
                break
            current = rung
        return current

    @property
    def prewarm_s(self) -> float:
        """Idle time at which a hot instance is (re)loaded; 0 if kept from the start."""
        return next((s for s, r in self.steps if r == Rung.HOT), float("inf"))

    @property
    def keepalive_s(self) -> float:
        """How long the hot instance stays once loaded (inf if it never leaves)."""
        start = self.prewarm_s
        return next((s - start for s, r in self.steps if s > start and r != Rung.HOT), float("inf"))
