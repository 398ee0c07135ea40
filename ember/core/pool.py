"""The pool: every instance on the node and its state, as plain data.

The controller mutates the pool as processes start, serve, pause and die; decisions
read an immutable `Snapshot` of it. Transitions are checked here so that a bug in an
adapter shows up as an error instead of a silently double-booked slice (an exclusive slice with two awake instances,
a shared one past its memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ember.core.slices import Slice
from ember.core.states import InstanceState, Rung

_ALLOWED: dict[InstanceState, frozenset[InstanceState]] = {
    InstanceState.STARTING: frozenset({InstanceState.BUSY, InstanceState.IDLE, InstanceState.STOPPED}),
    InstanceState.IDLE: frozenset({InstanceState.BUSY, InstanceState.PAUSED, InstanceState.ASLEEP,
                                   InstanceState.DRAINING, InstanceState.STOPPED}),
    InstanceState.BUSY: frozenset({InstanceState.BUSY, InstanceState.IDLE, InstanceState.DRAINING,
                                   InstanceState.STOPPED}),
    InstanceState.PAUSED: frozenset({InstanceState.BUSY, InstanceState.IDLE, InstanceState.ASLEEP,
                                     InstanceState.DRAINING, InstanceState.STOPPED}),
    InstanceState.ASLEEP: frozenset({InstanceState.BUSY, InstanceState.IDLE, InstanceState.DRAINING,
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
    sleep_levels: tuple[int, ...] = ()   # the engine's sleep levels (vLLM's on a GPU; () where it cannot sleep)
    asleep_level: int = 0                # the level it sleeps at (ASLEEP, or DRAINING from asleep), else 0
    held_mb: float = 0.0                 # then: memory it still holds on its slice (all of it until it says)
    slept: bool = False                  # its sleep began (until then, ASLEEP is only decided)
    memory_mb: int = 0                   # its model's memory_mb when it started (what it holds awake)

    def idle_for(self, now: float) -> float:
        return now - self.since if self.state.resting else 0.0

    @property
    def holds_slice(self) -> bool:
        """Holds its slice whole: awake, and not retiring from sleep (that one holds only `held_mb`)."""
        return self.state.awake and not (self.state is InstanceState.DRAINING and self.asleep_level > 0)

    @property
    def running(self) -> bool:
        """Working: starting, or a request in it (what a shared slice's `max_running` counts)."""
        return self.state is InstanceState.STARTING or self.inflight > 0

    @property
    def asleep_rung(self) -> Rung:
        return Rung.asleep(self.asleep_level)


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
    sleep_after_s: float | None = None   # idle seconds before an instance that can sleep is put to sleep (None: never)
    sleep_level: int = 1               # the level it sleeps at: 1 (weights to host memory) or 2 (discarded)
    dedicated: bool = False            # its instances run on exclusive slices only (`resources.dedicated_cores`)
    image_ready: bool = False          # its process image is on the node's disk (`ember serve --snapshots on`)

    @property
    def start_rung(self) -> Rung:
        """The rung a new instance starts from: the template, else the zygote, else its process image (RESTORE:
        loaded and warm, no zygote needed), else nothing kept (FETCH: the weights to pull, or the zygote to
        start)."""
        if self.has_template:
            return Rung.TEMPLATE
        if self.weights_local and self.runtime_ready:
            return Rung.ZYGOTE
        return Rung.RESTORE if self.image_ready else Rung.FETCH

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
        """Slices a start could have now, each with the memory left on it (`memory_mb`): an exclusive slice no awake
        instance holds (less what its asleep instances hold), a shared one with an instance's room to run."""
        return [replace(s, memory_mb=room) for s in self.slices
                if (room := self.room_on(s.id)) is not None and self.can_run(s.id)]

    def room_on(self, slice_id: str, without: tuple[str, ...] = ()) -> int | None:
        """MB a start (or a wake) could have on the slice, ignoring the instances `without`: its memory less what its
        instances hold (asleep: what they say they hold; on a shared slice, awake: their model's memory); None while
        an awake instance holds an exclusive slice."""
        slice_ = self.slice(slice_id)
        held = 0.0
        for inst in self.instances:
            if inst.slice_id != slice_id or inst.id in without or inst.state is InstanceState.STOPPED:
                continue
            if inst.holds_slice and not slice_.shared:
                return None
            held += inst.memory_mb if inst.holds_slice else inst.held_mb
        return max(0, int(slice_.memory_mb - math.ceil(held)))

    def slice(self, slice_id: str) -> Slice:
        return next(s for s in self.slices if s.id == slice_id)

    def can_run(self, slice_id: str) -> bool:
        """One more of the slice's instances may begin to work: always on an exclusive slice (its one awake
        instance), on a shared one while fewer than its `max_running` work (admission, not a count of instances)."""
        slice_ = self.slice(slice_id)
        return not slice_.shared or self.running_on(slice_id) < slice_.max_running

    def running_on(self, slice_id: str) -> int:
        return sum(1 for i in self.instances if i.slice_id == slice_id and i.running)

    def may_take(self, inst: Instance) -> bool:
        """A request may go to the instance now: it works already (the request joins it), or its slice lets one
        more instance work."""
        return inst.inflight > 0 or self.can_run(inst.slice_id)

    def slices_for(self, kind: str, dedicated: bool = False, among: list[Slice] | None = None) -> list[Slice]:
        """Of `among` (default: the node's slices), those a model may run on, memory aside: its kind, and exclusive
        ones for a dedicated model; a shared model runs on the shared slices, or on exclusive ones on a node with no
        shared slice of its kind (every CPU slot dedicated: each instance on one, as devices are)."""
        has_shared = any(s.shared and s.kind == kind for s in self.slices)
        return [s for s in (self.slices if among is None else among)
                if s.kind == kind and (not s.shared if dedicated or not has_shared else s.shared)]

    def can_wake(self, inst: Instance) -> bool:
        """An asleep instance can wake: nothing awake on its slice (an exclusive one), room there for its model's
        memory, and room to run."""
        room = self.room_on(inst.slice_id, without=(inst.id,))
        info = self.models.get(inst.model)
        return room is not None and info is not None and info.memory_mb <= room and self.can_run(inst.slice_id)


@dataclass
class Pool:
    slices: tuple[Slice, ...]
    models: dict[str, ModelInfo] = field(default_factory=dict)
    _instances: dict[str, Instance] = field(default_factory=dict)

    def snapshot(self) -> Snapshot:
        # list() copies the values at once: a status read on a worker thread snapshots while the loop adds one
        live = tuple(i for i in list(self._instances.values()) if i.state is not InstanceState.STOPPED)
        return Snapshot(instances=live, slices=self.slices, models=dict(self.models))

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def add_starting(self, instance_id: str, model: str, slice_id: str, rung: Rung, now: float) -> Instance:
        self._check_slice_free(slice_id, instance_id, model)
        info = self.models.get(model)
        inst = Instance(id=instance_id, model=model, slice_id=slice_id, rung=rung, state=InstanceState.STARTING,
                        started_at=now, since=now, memory_mb=info.memory_mb if info is not None else 0)
        self._instances[instance_id] = inst
        return inst

    def rename(self, placeholder: str, instance_id: str, pid: int, sleep_levels: tuple[int, ...] = ()) -> Instance:
        """A starting instance learns its real id, pid and sleep levels once the node has forked it."""
        inst = replace(self._instances.pop(placeholder), id=instance_id, pid=pid, sleep_levels=sleep_levels)
        self._instances[instance_id] = inst
        return inst

    def transition(self, instance_id: str, state: InstanceState, now: float) -> Instance:
        inst = self._require(instance_id)
        if state not in _ALLOWED[inst.state]:
            raise PoolError(f"instance {instance_id}: {inst.state.value} -> {state.value} is not allowed")
        if inst.state is InstanceState.ASLEEP and state in (InstanceState.BUSY, InstanceState.IDLE):
            self._check_slice_free(inst.slice_id, instance_id, inst.model)
        # Pausing or putting to sleep an idle instance does not reset its idle clock: recycling counts from the
        # last request.
        keeps_clock = state is inst.state or (inst.state.resting and state in (InstanceState.PAUSED,
                                                                               InstanceState.ASLEEP))
        since = inst.since if keeps_clock else now
        if state is InstanceState.ASLEEP and inst.state is not InstanceState.ASLEEP:
            # Until its engine says what it gave back, it holds all of its model's memory.
            info = self.models.get(inst.model)
            held = float(info.memory_mb) if info is not None else 0.0
            level = info.sleep_level if info is not None else 1
            updated = replace(inst, state=state, since=since, asleep_level=level, held_mb=held)
        elif state in (InstanceState.BUSY, InstanceState.IDLE, InstanceState.PAUSED):
            updated = replace(inst, state=state, since=since, asleep_level=0, held_mb=0.0, slept=False)
        else:
            updated = replace(inst, state=state, since=since)
        self._instances[instance_id] = updated
        return updated

    def sleep_begins(self, instance_id: str) -> None:
        """The node is putting the asleep instance's engine to sleep: a request now wakes it from its rung."""
        inst = self._require(instance_id)
        if inst.state is InstanceState.ASLEEP:
            self._instances[instance_id] = replace(inst, slept=True)

    def slept(self, instance_id: str, held_mb: float) -> None:
        """An asleep instance's engine says what it still holds on its slice."""
        inst = self._require(instance_id)
        if inst.state is InstanceState.ASLEEP:   # never more than it held awake
            self._instances[instance_id] = replace(inst, held_mb=min(max(0.0, held_mb), inst.held_mb))

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

    def _check_slice_free(self, slice_id: str, instance_id: str, model: str) -> None:
        """At most one awake instance on an exclusive slice, with room beside what the asleep ones there hold; on a
        shared slice, room beside what the others hold."""
        room = self.snapshot().room_on(slice_id, without=(instance_id,))
        if room is None:
            raise PoolError(f"slice {slice_id} is already in use")
        info = self.models.get(model)
        if info is not None and info.memory_mb > room:
            raise PoolError(f"slice {slice_id} has {room} MB beside its other instances, {model} needs "
                            f"{info.memory_mb}")

    def _require(self, instance_id: str) -> Instance:
        try:
            return self._instances[instance_id]
        except KeyError:
            raise PoolError(f"no instance {instance_id}") from None
