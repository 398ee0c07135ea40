"""Idle-capacity decisions: pause, recycle, pre-start, and the node's rungs, taken on every tick.

An idle instance is paused (SIGSTOP: memory kept, no CPU) after the model's
`pause_after_s`; one whose engine can sleep (vLLM's sleep mode, on a GPU) is put to sleep at the contract's
`sleep_after_s` (its device memory given back: its slice may host another instance meanwhile); each is
recycled after `max_idle_s` unless the model needs it to stay at
its min scale: `max_idle_s` is the user's keep-alive and wins over the autoscaler's
scale-to-zero grace. Models below min scale, or below what the autoscaler wants while
under load, get instances pre-started on free slices.

Scale-down is the autoscaler's (Knative's KPA: its stable window, scale-down rate and delay) down
to one instance: idle instances beyond its desire (`scale`) are recycled, least recently used
first. From one to zero, and the rung idle capacity sits on, are the keep-alive plan's (or the
contract's `max_idle_s`): the plan takes the place of the KPA's scale-to-zero grace period.

With a keep-alive plan, the rungs below an instance are carried out too: what the plan's rung for
the model's idle time keeps, the node keeps, and what it does not, the node releases (`KEEPS`):

    plan rung        template   zygote                                 weights in the memory tier
    HOT, PAUSED      kept       kept                                   kept
    TEMPLATE         kept       kept                                   kept
    ZYGOTE           released   kept                                   kept
    FETCH (nothing)  released   released, unless another model of      released, but for the chunks of
                                the runtime still wants it             the models that keep theirs

A template goes only once the model has no instance left (its instances die with it), a zygote only
once no model of its runtime has an instance or a template, a store-backed model's copy in the weight
store's memory tier (RAM) only once the model has no instance either. When the plan climbs back (pre-warm),
the missing rungs are made again (`MakeTemplate`, `MakeZygote`, `FillWeights`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from ember.core.pool import Instance, ModelInfo, Snapshot
from ember.core.rung_plan import IdlePlan
from ember.core.scheduler import best_fit
from ember.core.states import InstanceState, Rung


@dataclass(frozen=True)
class Pause:
    instance_id: str


@dataclass(frozen=True)
class Sleep:
    """Put an idle (or paused) instance's engine to sleep at `level`, then pause it."""

    instance_id: str
    level: int


@dataclass(frozen=True)
class Recycle:
    instance_id: str
    reason: str


@dataclass(frozen=True)
class Prestart:
    model: str
    rung: Rung
    slice_id: str


@dataclass(frozen=True)
class ReleaseTemplate:
    """Stop the model's template: its plan keeps nothing above the zygote now."""

    model: str


@dataclass(frozen=True)
class MakeTemplate:
    """Make the model's template again (and its runtime's zygote if gone): its plan climbed back."""

    model: str


@dataclass(frozen=True)
class ReleaseZygote:
    """Stop the runtime's zygote: every model of it is planned to keep nothing."""

    runtime: str


@dataclass(frozen=True)
class MakeZygote:
    """Start the runtime's zygote again: a model of it is planned to keep it."""

    runtime: str


@dataclass(frozen=True)
class ReleaseWeights:
    """Remove the store-backed model's chunks from the weight store's memory tier (the disk copy stays): its plan
    keeps nothing. Chunks the models in `keep` share with it stay: those models keep their weights."""

    model: str
    keep: frozenset[str] = frozenset()


@dataclass(frozen=True)
class FillWeights:
    """Copy the model's chunks up to the memory tier again: its plan climbed back above nothing."""

    model: str


RungAction = ReleaseTemplate | MakeTemplate | ReleaseZygote | MakeZygote | ReleaseWeights | FillWeights
Action = Pause | Sleep | Recycle | Prestart | RungAction


class Keeps(NamedTuple):
    template: bool   # the model's template
    zygote: bool     # its runtime's zygote
    weights: bool    # a store-backed model's chunks in the memory tier


# What the node keeps for a model whose plan holds each rung.
KEEPS: dict[Rung, Keeps] = {
    Rung.HOT: Keeps(True, True, True), Rung.PAUSED: Keeps(True, True, True),
    Rung.SLEEP_1: Keeps(True, True, True), Rung.SLEEP_2: Keeps(True, True, True),
    Rung.TEMPLATE: Keeps(True, True, True), Rung.ZYGOTE: Keeps(False, True, True),
    Rung.RESTORE: Keeps(False, False, False), Rung.FETCH: Keeps(False, False, False),
}


def decide(snapshot: Snapshot, now: float, desired: Mapping[str, int] | None = None,
           plans: Mapping[str, IdlePlan] | None = None,
           model_idle_s: Mapping[str, float] | None = None,
           zygotes: Collection[str] | None = None,
           scale: Mapping[str, int] | None = None) -> list[Action]:
    """What to do with idle capacity now.

    `desired` is the autoscaler's wish per model. `plans` come from a keep-alive policy
    (`ember.keepalive.policies`): the rung each model's idle capacity should sit on after each
    idle time; a model without one follows its contract (`pause_after_s`, `max_idle_s`).
    `model_idle_s` is how long each model has had no request, for a plan's pre-warm.
    `zygotes` names the runtimes whose zygote is up; given, the plans' lower rungs are carried out on
    the node too (see `KEEPS`, `rungs`). `scale` is the autoscaler's desire whatever the load (with
    its stable window, rates and delay): idle instances beyond max(it, 1, min scale) are recycled.
    """
    desired, plans, model_idle_s, scale = desired or {}, plans or {}, model_idle_s or {}, scale or {}
    actions: list[Action] = []
    for key, info in snapshot.models.items():
        mine = snapshot.of_model(key)
        # Instances already draining are on their way out: they do not count towards min scale.
        keep = sum(1 for i in mine if i.state is not InstanceState.DRAINING)
        plan = plans.get(key)
        # The autoscaler's floor: instances beyond it go whatever the plan says (never the last one).
        floor = max(1, info.min_scale, scale[key]) if key in scale else None
        # Oldest idle first, so the instances that survive are the most recently used.
        for inst in sorted(mine, key=lambda i: i.since):
            if not inst.state.resting:
                continue
            if floor is not None and keep > floor:
                actions.append(Recycle(inst.id, f"autoscaler wants {scale[key]}"))
                keep -= 1
                continue
            target = _target(info, plan, inst.idle_for(now))
            if target not in (Rung.HOT, Rung.PAUSED) and keep > info.min_scale:
                actions.append(Recycle(inst.id, f"idle {inst.idle_for(now):.0f}s: {_why(plan, info)}"))
                keep -= 1
            elif _sleeps(info, inst, now):
                actions.append(Sleep(inst.id, info.sleep_level))
            elif target is not Rung.HOT and inst.state is InstanceState.IDLE:
                # Paused is the cheapest rung an instance kept for min scale can sit on.
                actions.append(Pause(inst.id))
        want = max(info.min_scale, min(desired.get(key, 0), info.max_scale))
        if plan is not None and keep == 0 and key in model_idle_s and plan.rung_at(model_idle_s[key]) is Rung.HOT:
            want = max(want, 1)  # the policy's pre-warm window: an arrival is expected soon
        actions.extend(_prestarts(snapshot, key, want - keep, actions))
    if zygotes is not None:
        actions.extend(rungs(snapshot, plans, model_idle_s, zygotes))
    return actions


def rungs(snapshot: Snapshot, plans: Mapping[str, IdlePlan], model_idle_s: Mapping[str, float],
          zygotes: Collection[str]) -> list[RungAction]:
    """Templates, zygotes and memory-tier copies to release or make so the node keeps what each model's plan
    holds now.

    A model without a plan, or that never served (no idle time yet), keeps what it was deployed with;
    a model with an instance that is not idle (busy, starting) is treated as hot.
    """
    out: list[RungAction] = []
    wants = {key: _wants(info, plans.get(key), model_idle_s.get(key), snapshot.of_model(key))
             for key, info in snapshot.models.items()}
    for key, info in snapshot.models.items():
        mine = snapshot.of_model(key)
        if info.has_template and not wants[key].template and not mine:
            out.append(ReleaseTemplate(key))
        elif not info.has_template and wants[key].template:
            out.append(MakeTemplate(key))
    wanted_zygotes = {snapshot.models[key].runtime for key, w in wants.items() if w.zygote}
    for runtime in sorted({i.runtime for i in snapshot.models.values()}):
        if runtime in zygotes and runtime not in wanted_zygotes:
            out.append(ReleaseZygote(runtime))
        elif runtime not in zygotes and runtime in wanted_zygotes and not any(
                isinstance(a, MakeTemplate) and snapshot.models[a.model].runtime == runtime for a in out):
            out.append(MakeZygote(runtime))   # a template made again brings its zygote up on the way
    out.extend(_weights(snapshot, wants))
    return out


def _weights(snapshot: Snapshot, wants: Mapping[str, Keeps]) -> list[RungAction]:
    """The store-backed models' copies in the memory tier: released where the plan keeps nothing (and no
    instance maps them), but for the chunks shared with the models that keep theirs; filled again on the climb."""
    backed = {key for key, info in snapshot.models.items() if info.store_backed}
    keeping = frozenset(key for key in backed if wants[key].weights)
    out: list[RungAction] = []
    for key in sorted(backed):
        released = snapshot.models[key].weights_released
        if not released and not wants[key].weights:   # wanted while it has an instance (`_wants`)
            out.append(ReleaseWeights(key, keeping))
        elif released and wants[key].weights:
            out.append(FillWeights(key))
    return out


def zygote_holders(snapshot: Snapshot, plans: Mapping[str, IdlePlan],
                   model_idle_s: Mapping[str, float]) -> frozenset[str]:
    """The models that hold their runtime's zygote now: the rule `rungs` keeps a zygote by (one holder is
    enough), for the share of time others hold it (`ember.keepalive.zygote_share`)."""
    return frozenset(key for key, info in snapshot.models.items()
                     if _wants(info, plans.get(key), model_idle_s.get(key), snapshot.of_model(key)).zygote)


def _wants(info: ModelInfo, plan: IdlePlan | None, idle_s: float | None, mine: list[Instance]) -> Keeps:
    """What the model wants kept now: its template (its plan's rung keeps it, and the contract does), its
    runtime's zygote (its plan keeps it, or it keeps or is making a template, or it has an instance) and its
    weights in the memory tier (its plan keeps them, or it has an instance)."""
    keeps = _keeps(plan, idle_s, mine)
    want_template = keeps.template and info.keep_template
    keeps_template = want_template or (info.has_template and bool(mine))
    return Keeps(want_template, keeps.zygote or keeps_template or bool(mine), keeps.weights or bool(mine))


def _keeps(plan: IdlePlan | None, idle_s: float | None, mine: list[Instance]) -> Keeps:
    if plan is None or idle_s is None:
        return KEEPS[Rung.HOT]
    if any(not i.state.resting and i.state is not InstanceState.DRAINING for i in mine):
        return KEEPS[Rung.HOT]
    return KEEPS[plan.rung_at(idle_s)]


def _sleeps(info: ModelInfo, inst: Instance, now: float) -> bool:
    """Its contract puts it to sleep by now, and its engine can sleep at that level."""
    return (info.sleep_after_s is not None and inst.state in (InstanceState.IDLE, InstanceState.PAUSED)
            and info.sleep_level in inst.sleep_levels and inst.idle_for(now) >= info.sleep_after_s)


def _target(info: ModelInfo, plan: IdlePlan | None, idle_s: float) -> Rung:
    """The rung an instance idle for `idle_s` should sit on (anything below PAUSED: recycle it)."""
    if plan is not None:
        return plan.rung_at(idle_s)
    if idle_s >= info.max_idle_s:
        return Rung.TEMPLATE
    return Rung.PAUSED if idle_s >= info.pause_after_s else Rung.HOT


def _why(plan: IdlePlan | None, info: ModelInfo) -> str:
    return "keep-alive policy" if plan is not None else f"max_idle_s {info.max_idle_s:g}s"



def _prestarts(snapshot: Snapshot, key: str, missing: int, taken: list[Action]) -> list[Prestart]:
    info = snapshot.models[key]
    used = {a.slice_id for a in taken if isinstance(a, Prestart)}
    out: list[Prestart] = []
    rung = info.start_rung
    for _ in range(max(0, missing)):
        free = best_fit(snapshot.slices_for(info.slice_kind, info.dedicated,
                                            [s for s in snapshot.free_slices() if s.id not in used]), info)
        if free is None:
            break
        used.add(free.id)
        out.append(Prestart(key, rung, free.id))
    return out
