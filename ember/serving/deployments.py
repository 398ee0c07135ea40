"""One record per deployed model: its contract, state, autoscaler and idle history.

The controller used to keep nine per-model maps; a `Deployment` holds them together, so a model
is added and removed in one place and nothing can be left behind in one map and not another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from ember.core.autoscaler import Autoscaler
from ember.core.rung_plan import IdlePlan
from ember.core.throughput import ThroughputMeter
from ember.errors import ModelNotFound
from ember.keepalive.forecast import IdleHistory
from ember.keepalive.pooled_prior import PooledPrior
from ember.wire.contract import ModelContract


class ModelState(StrEnum):
    """A model's state as the V2 repository API names it."""

    LOADING = "LOADING"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass
class Deployment:
    contract: ModelContract
    state: ModelState = ModelState.LOADING
    reason: str = ""
    autoscaler: Autoscaler | None = None
    history: IdleHistory | None = None     # with a keep-alive policy: idle periods seen
    plan: IdlePlan | None = None           # and the policy's plan from them
    plan_zygote_others: float | None = None   # the zygote share the plan holds at (None: the even split)
    # The ladder's plan at the even split, from the same history: who holds the zygote is judged by it, as the
    # simulator's first pass does (judged by the marginal plans, two idle models would each keep the zygote
    # for the other, priced at nothing, and it would never go).
    even_plan: IdlePlan | None = None
    plan_prior: PooledPrior | None = None     # the node's pooled prior both were made with (the period's start)
    last_done: float | None = None         # when its last request finished (idle clock)
    waiting: int = 0                       # requests waiting for one of its instances to have room
    retry_at: float = 0.0                  # a failed pre-start is not retried before this
    retry_delay_s: float = 0.0
    heal_at: float = 0.0                   # a failed template repair is not retried before this
    heal_delay_s: float = 0.0
    # Its keep-alive plan released the template (and maybe the zygote) on purpose: the healer leaves it alone,
    # and the next start makes the template again on the way (`Instances.launch`).
    released: bool = False
    served: ThroughputMeter = field(default_factory=ThroughputMeter)
    failed_starts: int = 0                 # its starts that failed in a row (one that succeeds: 0)
    start_error: str = ""                  # why the last of them failed

    @property
    def key(self) -> str:
        return self.contract.key

    @property
    def ready(self) -> bool:
        return self.state is ModelState.READY

    @property
    def explained(self) -> str:
        """Its reason, and while its starts fail, why the last one did."""
        failing = f"its last {self.failed_starts} start(s) failed: {self.start_error}" if self.failing else ""
        return "; ".join(r for r in (self.reason, failing) if r)

    @property
    def failing(self) -> bool:
        """Its last start failed: until one succeeds, readiness counts it as unable to start an instance."""
        return self.failed_starts > 0


class Deployments:
    """Every model the controller knows: deployed ones by key, and names that failed to parse."""

    def __init__(self) -> None:
        self._by_key: dict[str, Deployment] = {}
        self._unavailable: dict[str, str] = {}  # a bad contract's name, an unloaded key -> why

    def add(self, contract: ModelContract) -> Deployment:
        self._unavailable.pop(contract.name, None)
        self._unavailable.pop(contract.key, None)
        deployment = Deployment(contract)
        self._by_key[contract.key] = deployment
        return deployment

    def remove(self, key: str, reason: str) -> None:
        self._by_key.pop(key, None)
        self._unavailable[key] = reason

    def unavailable(self, name: str, reason: str) -> None:
        """A model that is listed but cannot be deployed (an invalid contract)."""
        self._unavailable[name] = reason

    def failed(self) -> dict[str, str]:
        """Listed models that are not deployed (bad contracts, unloaded keys) and why."""
        return dict(self._unavailable)

    def get(self, key: str) -> Deployment | None:
        return self._by_key.get(key)

    def all(self) -> list[Deployment]:
        return list(self._by_key.values())

    def ready(self) -> list[Deployment]:
        return [d for d in self._by_key.values() if d.ready]

    def state_of(self, key: str) -> tuple[ModelState, str]:
        deployment = self._by_key.get(key)
        if deployment is not None:
            return deployment.state, deployment.explained
        if key in self._unavailable:
            return ModelState.UNAVAILABLE, self._unavailable[key]
        return ModelState.UNAVAILABLE, "not loaded"

    def find(self, name: str, version: str | None = None) -> Deployment:
        """The named model (its latest version when `version` is None); ModelNotFound otherwise."""
        found = [d for d in self._by_key.values() if d.contract.name == name and version in (None, d.contract.version)]
        if not found:
            raise ModelNotFound.absent(name, version)
        return max(found, key=lambda d: _version_order(d.contract.version))


def _version_order(version: str) -> tuple[int, int | str]:
    return (1, int(version)) if version.isdigit() else (0, version)
