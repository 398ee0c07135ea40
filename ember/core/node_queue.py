"""Work that has not begun waits at the node, where any instance of its model can take it.

A model whose instances step their sequences together (an LLM's continuous batching: the runtimes in `STEPS_SEQUENCES`)
is sent a request only while one of its instances runs fewer sequences than its batch (`ModelInfo.soft_limit`, the
target concurrency): a free sequence slot. The rest wait at the node, in arrival order, for whichever instance frees
a slot or comes up first, the one the autoscaler or an earlier request just started included, as vLLM's and
llama.cpp server's routers keep one queue per model, not per instance. Packed into a busy instance instead, they
would run there one prompt after another while a new instance sat idle. A sequence that has begun stays in its
instance, where its KV is.

`hold(decision, model, snapshot, ahead)` turns the ladder's placement (`scheduler.place`) into the node queue's:
- a route to an instance with a free slot stands, unless the requests queued `ahead` of this one need every free
  slot first (they take them in their order);
- a route past the batch (packing), or a wait for a busy or starting instance, becomes `Queue` while the model's
  instances, ready or starting, have room (`ModelInfo.per_instance` each) for this request behind those ahead: it
  waits as long as its deadline allows, as it would have waited inside an instance; beyond that room it is `Wait`
  (the server's short wait for room, then a job or an overload), as before;
- any other rung (resume, wake, start, evict, no capacity) stands: it brings up capacity, or says there is none.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.core.pool import ModelInfo, Snapshot
from ember.core.scheduler import Placement, Route, Wait
from ember.core.states import InstanceState

# Runtimes whose instances run their streams as one batch, stepped together (ember.runtimes.llm_decoder; vLLM).
STEPS_SEQUENCES = frozenset({"llm", "vllm"})


def queues_at_node(info: ModelInfo) -> bool:
    return info.runtime in STEPS_SEQUENCES


@dataclass(frozen=True)
class Queue:
    """Wait at the node for a free sequence slot in any of the model's instances (ready, or starting now)."""

    reason: str


def hold(decision: Placement, model: str, snapshot: Snapshot, ahead: int = 0) -> Placement | Queue:
    """The placement with the node queue applied (unchanged for a model that does not queue at the node). `ahead`:
    the model's requests queued at the node before this one."""
    info = snapshot.models[model]
    if not queues_at_node(info) or not isinstance(decision, Route | Wait):
        return decision
    mine = snapshot.of_model(model)
    if isinstance(decision, Route):
        target = next(i for i in mine if i.id == decision.instance_id)
        if target.inflight < info.soft_limit and free_slots(snapshot, model) > ahead:
            return decision
    room = sum(max(0, info.per_instance - i.inflight) for i in mine
               if i.state.ready or i.state is InstanceState.STARTING)
    if room > ahead:
        return Queue(f"{model}: {ahead} request(s) ahead wait for a free sequence slot")
    return decision if isinstance(decision, Wait) else Wait(f"{model}: {ahead} request(s) queued fill every instance")


def free_slots(snapshot: Snapshot, model: str) -> int:
    """Sequences the model's ready instances could begin now: each one's batch less the requests in it."""
    info = snapshot.models[model]
    return sum(max(0, info.soft_limit - i.inflight) for i in snapshot.of_model(model) if i.state.ready)
