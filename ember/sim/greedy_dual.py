"""FaaSCache: greedy-dual keep-alive under a node memory budget (Fuerst and Sharma, ASPLOS 2021).

FaaSCache ("Keeping Serverless Computing Alive with Greedy-Dual Caching") treats warm
instances as cache objects: nothing expires on a timer; an idle instance stays until the
node needs its memory for a new instance, and then the idle instances of lowest priority go
first. Each has the Greedy-Dual-Size-Frequency priority

    priority = clock + frequency * cost / size

where `frequency` counts the model's invocations since its instance started (reset when it
is evicted, as in GDSF caches), `cost` is the start latency an eviction adds (ember drops an
evicted instance to its runtime's zygote, so a zygote start instead of a hot one), `size` is
the instance's memory, and `clock` is the node's inflation clock: each eviction sets it to the
victim's priority, so instances not used for a long time sink below newly used ones (recency)
while frequently used, costly, small ones stay.

This module holds the policy's parameters and its priority rule (pure); the event-driven
node simulation that applies it is `ember.sim.shared_engine`. `LruEvict` is the same node
with the live scheduler's own victim order (`ember.core.scheduler._victim`: the longest idle
first), i.e. what ember does with no keep-alive timers and a full node. `LpBuffer` is the same node sized by
the LP buffer planner (`ember.core.warm_pool`, which the live warm pool runs) every period. All three are the
simulator's: the live node runs none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from ember.core.rung_costs import RungCosts
from ember.errors import InvalidInput

MB_PER_GB = 1024.0


@dataclass(frozen=True)
class FaaSCache:
    """Keep every idle instance until memory is needed; evict by least Greedy-Dual-Size-Frequency priority."""

    name: ClassVar[str] = "faascache"
    knob: ClassVar[str] = "budget_gb"
    budget_gb: float = 64.0     # memory for instances on the node (the runtimes' zygotes are outside it)

    def __post_init__(self) -> None:
        if not (0 < self.budget_gb <= 1e6):
            raise InvalidInput(f"{self.name}: budget_gb must lie in (0, 1e+06], got {self.budget_gb!r}")

    @property
    def budget_mb(self) -> float:
        return self.budget_gb * MB_PER_GB

    def priority(self, clock: float, frequency: float, idle_since: float, costs: RungCosts) -> float:
        """The instance's priority when it goes idle: evicted lowest first."""
        cost = max(costs.zygote.start_s - costs.hot.start_s, 0.0)
        return clock + frequency * cost / max(costs.hot.idle_mb, 1e-9)

    def knob_value(self) -> float:
        return float(self.budget_gb)

    def with_knob(self, value: float) -> FaaSCache:
        return replace(self, budget_gb=value)

    def sweep(self) -> tuple[float, ...]:
        return (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)


@dataclass(frozen=True)
class LruEvict(FaaSCache):
    """The live scheduler's victim order on the same node: the instance idle the longest goes first."""

    name: ClassVar[str] = "lru-evict"

    def priority(self, clock: float, frequency: float, idle_since: float, costs: RungCosts) -> float:
        return idle_since


@dataclass(frozen=True)
class LpBuffer(FaaSCache):
    """The shared node sized by the LP every `period_s`: idle instances the plan covers stay (or are loaded
    from the zygote), the others drop to the zygote; between plans a start that needs room evicts the idle
    instance least likely to be used in the coming period."""

    name: ClassVar[str] = "lp-buffer"
    latency_value: float = 1e5     # MB*s of idle memory worth one second of start latency (the ladder's knob)
    period_s: float = 60.0         # planning period

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (1e-3 <= self.latency_value <= 1e15):
            raise InvalidInput(f"{self.name}: latency_value must lie in [0.001, 1e+15], got {self.latency_value!r}")
        if not (1.0 <= self.period_s <= 86400.0):
            raise InvalidInput(f"{self.name}: period_s must lie in [1, 86400], got {self.period_s!r}")

    def start_saved_s(self, costs: RungCosts) -> float:
        return max(costs.zygote.start_s - costs.hot.start_s, 0.0)
