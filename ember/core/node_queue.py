"""Work that has not begun waits at the node, where any instance of its model can take it.

A model whose instances step their sequences together (an LLM's continuous batching: the runtimes in `STEPS_SEQUENCES`)
is sent a request only by an instance that can begin it now: one that runs fewer sequences than its batch
(`ModelInfo.soft_limit`, the target concurrency) and holds fewer than `BEGIN_AHEAD` requests it has not begun (no
first reply yet). The rest wait at the node, in arrival order, for whichever instance can begin one first: one that
fed a prompt, finished a stream, or just came up (started by the autoscaler or by a request of the same burst), as
vLLM's and llama.cpp server's routers keep one queue per model, not per instance. Sent to a busy instance instead,
they would wait there one prompt after another while another instance sat idle. A sequence that has begun stays in
its instance, where its KV is.

`place_queued(model, snapshot, ahead, unbegun)` is the ladder (`scheduler.place`) with the node queue applied; the
ladder sees every instance that cannot begin another request as full, so it routes to one that can, else resumes,
wakes or starts another instance where one may start (that start takes the request), else:
- `Queue` while the model's instances, ready or starting, have room for this request behind the `ahead` ones queued
  before it (`ModelInfo.per_instance` requests each, what they would have held): it waits as long as its deadline
  allows, as it would have waited inside an instance;
- past that room, what the ladder says of a full model (evict, wait for room briefly, no capacity), as before.
A route stands only while the instances can begin more requests than are queued ahead of it: they go first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from ember.core.pool import Instance, ModelInfo, Snapshot
from ember.core.scheduler import Placement, Resume, Route, Start, Wait, Wake, place
from ember.core.states import InstanceState

# Runtimes whose instances run their streams as one batch, stepped together (ember.runtimes.llm_decoder; vLLM).
STEPS_SEQUENCES = frozenset({"llm", "vllm"})
# Requests an instance is sent that it has not begun (no first reply yet): the prompt it feeds, and the next one, which
# its step fills with the room the first leaves (chunked prefill). The rest wait at the node, where any instance can
# take them.
BEGIN_AHEAD = 2


def queues_at_node(info: ModelInfo) -> bool:
    return info.runtime in STEPS_SEQUENCES


@dataclass(frozen=True)
class Queue:
    """Wait at the node for an instance that can begin the request (ready, or starting now)."""

    reason: str


def place_queued(model: str, snapshot: Snapshot, ahead: int = 0,
                 unbegun: Mapping[str, int] | None = None) -> Placement | Queue:
    """Where a request goes (`scheduler.place`, the node queue applied for a model that queues at the node).
    `ahead`: the model's requests queued at the node before this one; `unbegun`: per instance, the requests it holds
    that it has not begun (no first reply yet)."""
    info = snapshot.models[model]
    if not queues_at_node(info):
        return place(model, snapshot)
    unbegun = unbegun or {}
    decision = place(model, _as_seen(snapshot, info, unbegun))
    if isinstance(decision, Route):
        if free_slots(snapshot, model, unbegun) > ahead:
            return decision
    elif isinstance(decision, Resume | Wake | Start):
        return decision   # capacity comes up, and takes this request
    if _room(snapshot, model) > ahead:
        return Queue(f"{model}: {ahead} request(s) ahead wait for an instance to begin them")
    decision = place(model, snapshot)   # past the room of every instance: as any model's request
    return Wait(f"{model}: {ahead} request(s) queued fill every instance") if isinstance(decision, Route) \
        else decision


def free_slots(snapshot: Snapshot, model: str, unbegun: Mapping[str, int]) -> int:
    """Requests the model's instances could begin now: each ready one's batch less the requests in it, at most
    `BEGIN_AHEAD` less those it has not begun."""
    info = snapshot.models[model]
    return sum(max(0, min(info.soft_limit - i.inflight, BEGIN_AHEAD - unbegun.get(i.id, 0)))
               for i in snapshot.of_model(model) if i.state.ready and snapshot.may_take(i))


def _room(snapshot: Snapshot, model: str) -> int:
    """Requests the model's instances, ready (and allowed to work: `Snapshot.may_take`) or starting, hold at most
    beside those in them (`max_concurrency`). An idle one on shared cores that all work has none: the request waits
    for a core as any model's does (`queue_wait_s`), not at the node until its deadline."""
    info = snapshot.models[model]
    return sum(max(0, info.per_instance - i.inflight) for i in snapshot.of_model(model)
               if (i.state.ready and snapshot.may_take(i)) or i.state is InstanceState.STARTING)


def _as_seen(snapshot: Snapshot, info: ModelInfo, unbegun: Mapping[str, int]) -> Snapshot:
    """The pool as the ladder should see it for this model: an instance that cannot begin another request now (its
    batch full, or `BEGIN_AHEAD` not begun) is full, so the ladder neither packs it nor routes to it, and brings up
    another instance where one may start instead."""
    def seen(inst: Instance) -> Instance:
        full = inst.inflight >= info.soft_limit or unbegun.get(inst.id, 0) >= BEGIN_AHEAD
        return replace(inst, inflight=max(inst.inflight, info.per_instance)) if full else inst
    return replace(snapshot, instances=tuple(seen(i) if i.model == info.key else i for i in snapshot.instances))
