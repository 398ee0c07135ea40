"""Queued jobs that no node would claim: which node takes up their model.

A durable job is claimed by a node that serves its model and has room for it (`ember/serving/jobs.py`). A job
queued because every node was full, or whose model's nodes all left, can then wait for ever: the node with room
does not serve the model (a node the autoscaler added was given no model at all). Each time the controller
answers a report it decides, from the view alone, which node takes such a model up: the node deploys it and
its job runner claims the jobs.

    for each model with queued jobs (in key order):
        some node serving it can run one now (a warm instance with room, a paused one, or room to start one)
                                          -> nothing to do: that node claims them
        given to a live node in an earlier round that does not serve it yet
                                          -> that node still: it is deploying it (its own report says so only
                                             once the deploy is done, and its room is then spent on it, so a
                                             fresh placement would give the model to a second node as well)
        else                              -> `place` it (the cheapest rung by time to ready) among the nodes
                                             given no other model to take up in this round

One model per node per round: two models must not both count on the same free slice.

A model whose queued jobs no node serving it can run and no node was given to take up is *stranded*
(`stranded`): no node has room for it (every node full, or none at all: a worker group at zero). Its jobs are
demand for a machine, as a pending task is to Ray: the controller counts it as waiting for room
(`ember.core.scale_up`) for as long as it stays stranded, whether or not a request is being placed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ember.core.placement import ClusterSnapshot, NodeSnapshot, Placed, estimate, place

__all__ = ["TakeUp", "runnable", "stranded", "take_up"]


@dataclass(frozen=True)
class TakeUp:
    model: str
    node: str
    jobs: int              # queued when decided
    placed: Placed | None  # the placement it follows (rung, time to ready); None: given in an earlier round


def _can_run(model: str, node: NodeSnapshot, snapshot: ClusterSnapshot) -> bool:
    if any(w.model == model and w.room for w in node.warm):
        return True
    return estimate(snapshot.spec(model), node, snapshot) is not None


def runnable(model: str, snapshot: ClusterSnapshot, serving: Mapping[str, frozenset[str]]) -> bool:
    """Some node serving `model` (deployed there) can run one of its requests now."""
    return any(_can_run(model, n, snapshot) for n in snapshot.nodes if model in serving.get(n.id, frozenset()))


def _wanting(snapshot: ClusterSnapshot, queued: Mapping[str, int],
             serving: Mapping[str, frozenset[str]]) -> list[str]:
    """Models with queued jobs that no node serving them can run now, in key order."""
    return [m for m in sorted(queued) if queued[m] > 0 and m in snapshot.models and not runnable(m, snapshot, serving)]


def stranded(snapshot: ClusterSnapshot, queued: Mapping[str, int], serving: Mapping[str, frozenset[str]],
             decided: tuple[TakeUp, ...]) -> tuple[str, ...]:
    """The models with queued jobs that no node serving them can run and no node takes up (`decided`, what
    `take_up` returned): they need another machine."""
    given = {t.model for t in decided}
    return tuple(m for m in _wanting(snapshot, queued, serving) if m not in given)


def take_up(snapshot: ClusterSnapshot, queued: Mapping[str, int], serving: Mapping[str, frozenset[str]],
            given: Mapping[str, str] | None = None) -> tuple[TakeUp, ...]:
    """The nodes to deploy models whose queued jobs (`queued`: model key -> jobs) no node serving them
    (`serving`: node id -> model keys deployed there) can run now; `given` (model key -> node id) is what earlier
    rounds decided. Models the snapshot does not know (no live node was given them, none remembers them) are left
    queued."""
    wanting = _wanting(snapshot, queued, serving)
    # The nodes still deploying a model given earlier are reserved first: a fresh placement of another model
    # (earlier in key order) must not take such a node and push its model onto a second one.
    live = {n.id for n in snapshot.nodes}
    kept: dict[str, str] = {}
    for model in wanting:
        node = (given or {}).get(model)
        if node is not None and node in live and node not in kept.values() \
                and model not in serving.get(node, frozenset()):
            kept[model] = node
    out = [TakeUp(m, node, queued[m], None) for m, node in kept.items()]
    taken = set(kept.values())
    for model in (m for m in wanting if m not in kept):
        rest = ClusterSnapshot(tuple(n for n in snapshot.nodes if n.id not in taken), snapshot.models,
                               snapshot.origin_bps, snapshot.service_s, snapshot.costs)
        placement = place(model, rest)
        if isinstance(placement, Placed):
            taken.add(placement.node)
            out.append(TakeUp(model, placement.node, queued[model], placement))
    return tuple(sorted(out, key=lambda t: t.model))
