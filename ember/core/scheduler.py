"""Placement: which rung of the cold-start ladder serves a request.

`place(model, snapshot)` walks the ladder and returns the first rung that can serve:
hot (an instance under its target concurrency), paused (resume it), asleep (wake its engine, level 1
before level 2, where nothing awake holds its slice), template fork or zygote fork on a free slice,
hot again (an instance under its hard limit, `max_concurrency`), then either evicting another model's
idle instance to free a slice (or memory on a shared one), waiting for one of the model's own busy or starting
instances (or for room to run on the node's shared cores), or no capacity (a durable job). On a shared slice an
instance that is not working takes a request only while fewer than the slice's `max_running` work
(`Snapshot.may_take`): admission bounds the work that runs at once, not the instances that exist.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ember.core.pool import Instance, ModelInfo, Snapshot
from ember.core.slices import Slice
from ember.core.states import InstanceState, Rung


@dataclass(frozen=True)
class Route:
    instance_id: str
    rung: Rung = Rung.HOT


@dataclass(frozen=True)
class Resume:
    instance_id: str
    rung: Rung = Rung.PAUSED


@dataclass(frozen=True)
class Wake:
    """Wake an asleep instance's engine (SLEEP_1: weights back from host memory; SLEEP_2: reloaded)."""

    instance_id: str
    rung: Rung


@dataclass(frozen=True)
class Start:
    rung: Rung           # TEMPLATE, ZYGOTE or FETCH
    slice_id: str


@dataclass(frozen=True)
class Evict:
    """Stop another model's idle instance to free its slice, then start on it."""

    victim_id: str
    rung: Rung
    slice_id: str


@dataclass(frozen=True)
class Wait:
    """The model's own instances are busy or starting and no more may start: wait for one."""

    reason: str


@dataclass(frozen=True)
class NoCapacity:
    reason: str


Placement = Route | Resume | Wake | Start | Evict | Wait | NoCapacity


def place(model: str, snapshot: Snapshot) -> Placement:
    info = snapshot.models[model]
    mine = snapshot.of_model(model)
    # Spread before packing: an instance under its target concurrency first, then a paused or a new one
    # (each on a slice of its own), and only then more requests into instances up to their hard limit,
    # which batching instances turn into bigger forward passes.
    hot = _least_loaded(snapshot, mine, info.soft_limit)
    if hot is not None:
        return Route(hot.id)
    paused = [i for i in mine if i.state is InstanceState.PAUSED and snapshot.can_run(i.slice_id)]
    if paused:
        # The most recently used paused instance has the warmest caches.
        return Resume(max(paused, key=lambda i: i.since).id)
    asleep = [i for i in mine if i.state is InstanceState.ASLEEP and snapshot.can_wake(i)]
    if asleep:
        woken = min(asleep, key=_wake_order)
        return Wake(woken.id, woken.asleep_rung)
    rung = info.start_rung
    can_grow = len(mine) < info.max_scale
    free = best_fit(snapshot.slices_for(info.slice_kind, info.dedicated, snapshot.free_slices()), info) \
        if can_grow else None
    if free is not None:
        return Start(rung, free.id)
    packed = _least_loaded(snapshot, mine, info.per_instance)
    if packed is not None:
        return Route(packed.id)
    blocking = _blocking_a_wake(snapshot, info, mine)
    if blocking is not None:   # evicted, the next walk wakes the model's own instance on that slice
        blocker, own = blocking
        return Evict(blocker.id, own.asleep_rung, blocker.slice_id)
    victim = _victim(snapshot, info) if can_grow else None
    if victim is not None:
        return Evict(victim.id, rung, victim.slice_id)
    if any(i.state in (InstanceState.BUSY, InstanceState.STARTING) for i in mine):
        return Wait(f"{model}: all {len(mine)} instance(s) busy")
    if _draining_fit(snapshot, info):
        return Wait(f"{model}: waiting for a slice being drained")
    crowded = _crowded(snapshot, info)
    if crowded is not None:
        return Wait(f"{model}: {crowded.max_running} instance(s) already work on the {crowded.id} slice's cores")
    return NoCapacity(f"{model}: no free {info.slice_kind} slice with {info.memory_mb} MB")


def _least_loaded(snapshot: Snapshot, mine: list[Instance], limit: int) -> Instance | None:
    ready = [i for i in mine if i.state.ready and i.inflight < limit and snapshot.may_take(i)]
    if not ready:
        return None
    # Least loaded first; among equals the most recently used (its caches are warm).
    return min(ready, key=lambda i: (i.inflight, -i.since))


def _draining_fit(snapshot: Snapshot, info: ModelInfo) -> bool:
    """An instance is being stopped on a slice this model fits: it frees in a moment."""
    slices = {s.id: s for s in snapshot.slices_for(info.slice_kind, info.dedicated)}
    return any(i.state is InstanceState.DRAINING and i.slice_id in slices
               and slices[i.slice_id].fits(info.slice_kind, info.memory_mb) for i in snapshot.instances)


def _crowded(snapshot: Snapshot, info: ModelInfo) -> Slice | None:
    """A shared slice the model could run on but for the instances already working there: the request waits for
    one of them to finish."""
    for slice_ in snapshot.slices_for(info.slice_kind, info.dedicated):
        if slice_.shared and not snapshot.can_run(slice_.id) and info.memory_mb <= slice_.memory_mb:
            return slice_
    return None


def best_fit(slices: list[Slice], info: ModelInfo) -> Slice | None:
    fits = [s for s in slices if s.fits(info.slice_kind, info.memory_mb)]
    # Best fit: the smallest slice that holds the model keeps big slices for big models.
    return min(fits, key=lambda s: (s.memory_mb, s.id)) if fits else None


def _victim(snapshot: Snapshot, info: ModelInfo) -> Instance | None:
    """An idle, paused or asleep instance of another model, above that model's min scale, whose slice fits the
    model once it is gone (what other asleep instances hold there counted)."""
    slices = {s.id: s for s in snapshot.slices_for(info.slice_kind, info.dedicated)}
    candidates, shared = [], []
    for inst in snapshot.instances:
        if inst.model == info.key or not inst.state.resting or inst.slice_id not in slices:
            continue
        if not _above_min_scale(snapshot, inst) or not snapshot.can_run(inst.slice_id):
            continue
        if slices[inst.slice_id].shared:
            shared.append(inst)
            continue
        room = snapshot.room_on(inst.slice_id, without=(inst.id,))
        if room is not None and info.memory_mb <= room and slices[inst.slice_id].fits(info.slice_kind, room):
            candidates.append(inst)
    candidates += _shared_victims(snapshot, info, shared)
    # Asleep, then paused, then idle, then the longest idle: the least likely to be needed soon.
    return min(candidates, key=lambda i: (_EVICT_FIRST.get(i.state, 2), i.since), default=None)


def _shared_victims(snapshot: Snapshot, info: ModelInfo, resting: list[Instance]) -> list[Instance]:
    """Of the evictable instances on shared slices, those on a slice where the model fits once they (one per walk)
    are gone, and does not already fit once its draining instances are."""
    out = []
    for slice_id in {i.slice_id for i in resting}:
        here = [i for i in resting if i.slice_id == slice_id]
        if _drain_frees(snapshot, slice_id, info.memory_mb):
            continue   # what drains frees enough: wait for it
        if (snapshot.room_on(slice_id, without=_draining(snapshot, slice_id) + tuple(i.id for i in here)) or 0) \
                >= info.memory_mb:
            out += here
    return out


def _draining(snapshot: Snapshot, slice_id: str) -> tuple[str, ...]:
    return tuple(i.id for i in snapshot.instances if i.slice_id == slice_id and i.state is InstanceState.DRAINING)


def _drain_frees(snapshot: Snapshot, slice_id: str, memory_mb: int, without: tuple[str, ...] = ()) -> bool:
    """A shared slice's draining instances, once gone, leave `memory_mb` (beside the instances `without`): a start
    or a wake there waits for them rather than evicting another."""
    draining = _draining(snapshot, slice_id)
    return snapshot.slice(slice_id).shared and bool(draining) \
        and (snapshot.room_on(slice_id, without=without + draining) or 0) >= memory_mb


_EVICT_FIRST = {InstanceState.ASLEEP: 0, InstanceState.PAUSED: 1}


def _above_min_scale(snapshot: Snapshot, inst: Instance) -> bool:
    """Its model keeps more instances than its min scale (a model no longer deployed: nothing to keep)."""
    model = snapshot.models.get(inst.model)
    return model is None or len(snapshot.of_model(inst.model)) > model.min_scale


def _wake_order(inst: Instance) -> tuple[int, float]:
    """The lightest sleep first (level 1 copies weights back; level 2 reads them again), then the most recent."""
    return inst.asleep_level, -inst.since


def _blocking_a_wake(snapshot: Snapshot, info: ModelInfo, mine: list[Instance]) -> tuple[Instance, Instance] | None:
    """An idle or paused instance of another model (above its min scale) holding the slice of one of this model's
    asleep instances, which could wake there once it is gone: (that instance, the asleep one)."""
    asleep = sorted((i for i in mine if i.state is InstanceState.ASLEEP), key=_wake_order)
    for own in (i for i in asleep if snapshot.can_run(i.slice_id)):
        if _drain_frees(snapshot, own.slice_id, info.memory_mb, without=(own.id,)):
            continue   # another request's eviction frees the room for its wake: wait for it, evict no more
        for other in snapshot.instances:
            if other.slice_id != own.slice_id or not other.holds_slice:
                continue
            evictable = other.state in (InstanceState.IDLE, InstanceState.PAUSED) and _above_min_scale(snapshot, other)
            room = snapshot.room_on(own.slice_id, without=(own.id, other.id))
            if evictable and room is not None and info.memory_mb <= room:
                return other, own
    return None


def startable_slices(snapshot: Snapshot) -> list[Slice]:
    """The slices a start could have now: the free ones (with the room their asleep instances leave), and those
    held by an idle, paused or asleep instance that `_victim` may evict (above its model's min scale), with the room
    it would leave: what this node offers the cluster's placement. Each slice once."""
    out = {s.id: s for s in snapshot.free_slices()}
    slices = {s.id: s for s in snapshot.slices}
    for key, info in snapshot.models.items():
        mine = snapshot.of_model(key)
        idle = sorted((i for i in mine if i.state.resting), key=lambda i: (_EVICT_FIRST.get(i.state, 2), i.since))
        for inst in idle[:max(0, len(mine) - info.min_scale)]:
            room = snapshot.room_on(inst.slice_id, without=(inst.id,))
            if room is not None and snapshot.can_run(inst.slice_id) \
                    and room > out.get(inst.slice_id, Slice("", "", -1)).memory_mb:
                out[inst.slice_id] = replace(slices[inst.slice_id], memory_mb=room)
    return list(out.values())
