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

from ember.core.pool import Snapshot
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


def decide(snapshot: Snapshot, now: float, desired: Mapping[str, int] | None = None) -> list[Action]:
    """What to do with idle capacity now. `desired` is the autoscaler's wish per model."""
    desired = desired or {}
    actions: list[Action] = []
    for key, info in snapshot.models.items():
        mine = snapshot.of_model(key)
        keep = len(mine)
        # Oldest idle first, so the instances that survive are the most recently used.
        for inst in sorted(mine, key=lambda i: i.since):
            if inst.state not in (InstanceState.IDLE, InstanceState.PAUSED):
                continue
            idle = inst.idle_for(now)
            if idle >= info.max_idle_s and keep > info.min_scale:
                actions.append(Recycle(inst.id, f"idle {idle:.0f}s >= max_idle_s {info.max_idle_s:g}s"))
                keep -= 1
            elif inst.state is InstanceState.IDLE and idle >= info.pause_after_s:
                actions.append(Pause(inst.id))
        want = max(info.min_scale, min(desired.get(key, 0), info.max_scale))
        actions.extend(_prestarts(snapshot, key, want - keep, actions))
    return actions


def _prestarts(snapshot: Snapshot, key: str, missing: int, taken: list[Action]) -> list[Prestart]:
    info = snapshot.models[key]
    used = {a.slice_id for a in taken if isinstance(a, Prestart)}
    out: list[Prestart] = []
    rung = Rung.TEMPLATE if info.has_template else Rung.ZYGOTE
    for _ in range(max(0, missing)):
        free = best_fit([s for s in snapshot.free_slices() if s.id not in used], info)
        if free is None:
            break
        used.add(free.id)
        out.append(Prestart(key, rung, free.id))
    return out
