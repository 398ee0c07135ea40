"""Idle-capacity decisions: pause, recycle and pre-start, taken on every tick.

An idle instance is paused (SIGSTOP: memory kept, no CPU) after the model's
`pause_after_s`, and recycled after `max_idle_s` unless the model needs it to stay at
its min scale: `max_idle_s` is the user's keep-alive and wins over the autoscaler's
scale-to-zero grace. Models below min scale, or below what the autoscaler wants while
under load, get instances pre-started on free slices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ember.core.keepalive import IdlePlan
from ember.core.pool import ModelInfo, Snapshot
from ember.core.scheduler import best_fit
from ember.core.states import InstanceState, Rung


@dataclass(frozen=True)
class Pause:
    instance_id: str


@dataclass(frozen=True)
class Recycle:
    instance_id: str
    reason: str


@dataclass(frozen=True)
class Prestart:
    model: str
    rung: Rung
    slice_id: str


Action = Pause | Recycle | Prestart


def decide(snapshot: Snapshot, now: float, desired: Mapping[str, int] | None = None,
           plans: Mapping[str, IdlePlan] | None = None,
           model_idle_s: Mapping[str, float] | None = None) -> list[Action]:
    """What to do with idle capacity now.

    `desired` is the autoscaler's wish per model. `plans` come from a keep-alive policy
    (`ember.core.keepalive`): the rung each model's idle capacity should sit on after each
    idle time; a model without one follows its contract (`pause_after_s`, `max_idle_s`).
    `model_idle_s` is how long each model has had no request, for a plan's pre-warm.
    """
    desired, plans, model_idle_s = desired or {}, plans or {}, model_idle_s or {}
    actions: list[Action] = []
    for key, info in snapshot.models.items():
        mine = snapshot.of_model(key)
        # Instances already draining are on their way out: they do not count towards min scale.
        keep = sum(1 for i in mine if i.state is not InstanceState.DRAINING)
        plan = plans.get(key)
        # Oldest idle first, so the instances that survive are the most recently used.
        for inst in sorted(mine, key=lambda i: i.since):
            if inst.state not in (InstanceState.IDLE, InstanceState.PAUSED):
                continue
            target = _target(info, plan, inst.idle_for(now))
            if target not in (Rung.HOT, Rung.PAUSED) and keep > info.min_scale:
                actions.append(Recycle(inst.id, f"idle {inst.idle_for(now):.0f}s: {_why(plan, info)}"))
                keep -= 1
            elif target is not Rung.HOT and inst.state is InstanceState.IDLE:
                # Paused is the cheapest rung an instance kept for min scale can sit on.
                actions.append(Pause(inst.id))
        want = max(info.min_scale, min(desired.get(key, 0), info.max_scale))
        if plan is not None and keep == 0 and key in model_idle_s and plan.rung_at(model_idle_s[key]) is Rung.HOT:
            want = max(want, 1)  # the policy's pre-warm window: an arrival is expected soon
        actions.extend(_prestarts(snapshot, key, want - keep, actions))
    return actions


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
        free = best_fit([s for s in snapshot.free_slices() if s.id not in used], info)
        if free is None:
            break
        used.add(free.id)
        out.append(Prestart(key, rung, free.id))
    return out
