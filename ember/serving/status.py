"""`ember status`'s view of a model: its state, template memory and every instance."""

from __future__ import annotations

from typing import Any

from ember.core.pool import Instance
from ember.errors import EmberError
from ember.node.api import MemoryUsage, Node
from ember.serving.results import ModelStatus
from ember.wire.contract import ModelContract


def model_status(contract: ModelContract, state: str, reason: str, instances: list[Instance], node: Node,
                 now: float) -> ModelStatus:
    tmpl = node.template_memory(contract.key)
    template = {"rss_bytes": tmpl.rss_bytes, "pss_bytes": tmpl.pss_bytes, "pid": tmpl.pid} if tmpl else None
    return ModelStatus(contract.name, contract.version, state if not reason else f"{state}: {reason}",
                       template, [_instance(inst, node, now) for inst in instances])


def _instance(inst: Instance, node: Node, now: float) -> dict[str, Any]:
    mem = _memory(node, inst.id) if inst.pid else None
    return {
        "id": inst.id, "state": inst.state.value, "rung": inst.rung.value, "pid": inst.pid,
        "slice": inst.slice_id, "idle_s": round(inst.idle_for(now), 3), "inflight": inst.inflight,
        "served": inst.served, "rss_bytes": mem.rss_bytes if mem else None,
        "pss_bytes": mem.pss_bytes if mem else None, "uss_bytes": mem.uss_bytes if mem else None,
        **({"sleep_level": inst.asleep_level, "held_mb": round(inst.held_mb, 1)} if inst.asleep_level else {}),
    }


def _memory(node: Node, instance_id: str) -> MemoryUsage | None:
    try:
        return node.memory(instance_id)
    except EmberError:  # it exited while we looked
        return None
