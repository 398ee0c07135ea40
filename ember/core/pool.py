"""The pool: every instance on the node and its state, as plain data.

The controller mutates the pool as processes start, serve, pause and die; decisions
read an immutable `Snapshot` of it. Transitions are checked here so that a bug in an
adapter shows up as an error instead of a silently double-booked slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ember.core.slices import Slice
from ember.core.states import InstanceState, Rung

_ALLOWED: dict[InstanceState, frozenset[InstanceState]] = {
    InstanceState.STARTING: frozenset({InstanceState.BUSY, InstanceState.IDLE, InstanceState.STOPPED}),
    InstanceState.IDLE: frozenset({InstanceState.BUSY, InstanceState.PAUSED, InstanceState.DRAINING,
                                   InstanceState.STOPPED}),
    InstanceState.BUSY: frozenset({InstanceState.BUSY, InstanceState.IDLE, InstanceState.DRAINING,
                                   InstanceState.STOPPED}),
    InstanceState.PAUSED: frozenset({InstanceState.BUSY, InstanceState.IDLE, InstanceState.DRAINING,
                                     InstanceState.STOPPED}),
    InstanceState.DRAINING: frozenset({InstanceState.STOPPED}),
    InstanceState.STOPPED: frozenset(),
}


class PoolError(Exception):
    """A transition the state machine does not allow (a bug, not a user error)."""


@dataclass(frozen=True)
class Instance:
    id: str
    model: str                 # contract key "name:version"
    slice_id: str
    rung: Rung                 # the rung it was started from
    state: InstanceState
    started_at: float
    since: float               # when it entered `state` (idle time = now - since when IDLE/PAUSED)
    inflight: int = 0
    pid: int | None = None
    served: int = 0

    def idle_for(self, now: float) -> float:
        return now - self.since if self.state in (InstanceState.IDLE, InstanceState.PAUSED) else 0.0


@dataclass(frozen=True)
class ModelInfo:
    """What decisions need to know of a deployed model."""

    key: str
    slice_kind: str
    memory_mb: int
    min_scale: int
    max_scale: int
    target_concurrency: float
    pause_after_s: float
    max_idle_s: float
    has_template: bool
    runtime_ready: bool = True     # the runtime's zygote is up (False: a keep-alive plan released it)
    weights_local: bool = True     # False: a start must first fetch the weights (the FETCH rung)
    max_concurrency: int | None = None   # requests one instance holds at once (None: the target, at least 1)
    runtime: str = ""              # the runtime whose zygote the model forks from
    keep_template: bool = False    # the contract keeps a template (a plan may release it, and make it again)
    store_backed: bool = False     # its weights are in the node's weight store, which has a memory tier (RAM)
    memory_copy_mb: float = 0.0    # the size of its chunks' copy in that tier (a keep-alive plan prices it)
    weights_released: bool = False   # a plan released its chunks from that tier (`FillWeights` brings them back)

    @property
    def start_rung(self) -> Rung:
        """The rung a new instance starts from: the template, else the zygote, else nothing kept (FETCH: the
        weights to pull, or the zygote to start)."""
        if self.has_template:
            return Rung.TEMPLATE
        return Rung.ZYGOTE if self.weights_local and self.runtime_ready else Rung.FETCH

    @property
    def soft_limit(self) -> int:
        """Requests an instance takes before the scheduler prefers another instance (its target)."""
        return min(self.per_instance, max(1, math.ceil(self.target_concurrency)))

    @property
    def per_instance(self) -> int:
        """Requests one instance takes at once: its hard limit, else the target concurrency (at least 1)."""
        return self.max_concurrency or max(1, int(self.target_concurrency))


@dataclass(frozen=True)
class Snapshot:
    instances: tuple[Instance, ...]
    slices: tuple[Slice, ...]
    models: dict[str, ModelInfo]

    def of_model(self, key: str) -> list[Instance]:
        return [i for i in self.instances if i.model == key and i.state is not InstanceState.STOPPED]

    def free_slices(self) -> list[Slice]:
        used = {i.slice_id for i in self.instances if i.state is not InstanceState.STOPPED}
        return [s for s in self.slices if s.id not in used]


@dataclass
class Pool:
    slices: tuple[Slice, ...]
    models: dict[str, ModelInfo] = field(default_factory=dict)
    _instances: dict[str, Instance] = field(default_factory=dict)

    def snapshot(self) -> Snapshot:
        live = tuple(i for i in self._instances.values() if i.state is not InstanceState.STOPPED)
        return Snapshot(instances=live, slices=self.slices, models=dict(self.models))

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def add_starting(self, instance_id: str, model: str, slice_id: str, rung: Rung, now: float) -> Instance:
        if any(i.slice_id == slice_id and i.state is not InstanceState.STOPPED for i in self._instances.values()):
            raise PoolError(f"slice {slice_id} is already in use")
        inst = Instance(id=instance_id, model=model, slice_id=slice_id, rung=rung,
                        state=InstanceState.STARTING, started_at=now, since=now)
        self._instances[instance_id] = inst
        return inst

    def rename(self, placeholder: str, instance_id: str, pid: int) -> Instance:
        """A starting instance learns its real id and pid once the node has forked it."""
        inst = replace(self._instances.pop(placeholder), id=instance_id, pid=pid)
        self._instances[instance_id] = inst
        return inst

    def transition(self, instance_id: str, state: InstanceState, now: float) -> Instance:
        inst = self._require(instance_id)
        if state not in _ALLOWED[inst.state]:
            raise PoolError(f"instance {instance_id}: {inst.state.value} -> {state.value} is not allowed")
        # Pausing an idle instance does not reset its idle clock: recycling counts from the last request.
        keeps_clock = state is inst.state or (inst.state is InstanceState.IDLE and state is InstanceState.PAUSED)
        since = inst.since if keeps_clock else now
        updated = replace(inst, state=state, since=since)
        self._instances[instance_id] = updated
        return updated

    def acquire(self, instance_id: str, now: float) -> Instance:
        """One more request in flight (the instance becomes BUSY)."""
        inst = self.transition(instance_id, InstanceState.BUSY, now)
        updated = replace(inst, inflight=inst.inflight + 1)
        self._instances[instance_id] = updated
        return updated

    def release(self, instance_id: str, now: float, *, served: bool = True) -> Instance:
        """A request finished (or, `served=False`, gave its claim back unsent); the instance is
        IDLE again when nothing else is in flight."""
        inst = self._require(instance_id)
        if inst.state is InstanceState.STOPPED:
            return inst
        inflight = max(0, inst.inflight - 1)
        count = inst.served + 1 if served else inst.served
        if inflight == 0 and inst.state is InstanceState.BUSY:
            inst = self.transition(instance_id, InstanceState.IDLE, now)
        updated = replace(inst, inflight=inflight, served=count)
        self._instances[instance_id] = updated
        return updated

    def stopped(self, instance_id: str, now: float) -> Instance | None:
        """Mark gone (idempotent: exits are reported by more than one path)."""
        inst = self._instances.get(instance_id)
        if inst is None or inst.state is InstanceState.STOPPED:
            return inst
        return self.transition(instance_id, InstanceState.STOPPED, now)

    def forget_stopped(self) -> None:
        self._instances = {k: v for k, v in self._instances.items() if v.state is not InstanceState.STOPPED}

    def _require(self, instance_id: str) -> Instance:
        try:
            return self._instances[instance_id]
        except KeyError:
            raise PoolError(f"no instance {instance_id}") from None
