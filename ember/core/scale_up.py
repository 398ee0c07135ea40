"""When to ask for more machines (issue 14): the cluster controller's scale-up decision, pure.

A start the controller cannot place because every node is full (`Unplaceable.for_room`; a model too large for
every node is refused at registration instead, `ModelTooLarge`, and no new node of the same kind would help)
makes its model *wait for room*. While models wait, the controller asks Ray's autoscaler for the cluster to
have `nodes` machines: the nodes there were when the first of them found no room, plus one per waiting
model, at most `max_nodes`. Ray's `request_resources` is declarative (each call replaces the last) and counts
every node the cluster has, busy or not, hence a cluster size and not a number of new nodes.

A model placed again stops waiting; one not seen without room for `hold_s` (long enough for a machine to join:
a KubeRay pod takes about a minute) stops waiting too, and with none waiting the request is withdrawn
(`nodes` 0), so the autoscaler may remove idle machines again. A node that joined while a model still finds no
room (it was too small, or filled up at once) moves that model's base to the new size: one more node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Waiting:
    since: float      # when it last found no room
    base: int         # how many nodes there were when it started waiting (or when the last one joined)


@dataclass(frozen=True)
class ScaleUp:
    nodes: int        # the cluster size to ask for; 0: withdraw the request
    models: tuple[str, ...]


def found_no_room(waiting: Mapping[str, Waiting], model: str, now: float, live: int) -> dict[str, Waiting]:
    """`model` found every one of `live` nodes full at `now`."""
    before = waiting.get(model)
    base = live if before is None or live > before.base else before.base
    return {**waiting, model: Waiting(now, base)}


def placed(waiting: Mapping[str, Waiting], model: str) -> dict[str, Waiting]:
    """`model` was placed: it waits no more."""
    return {m: w for m, w in waiting.items() if m != model}


def decide(waiting: Mapping[str, Waiting], now: float, *, hold_s: float, max_nodes: int) -> ScaleUp:
    """The request to make now (the caller makes it only when it differs from the last one made)."""
    active = {m: w for m, w in waiting.items() if now - w.since <= hold_s}
    if not active:
        return ScaleUp(0, ())
    nodes = max(w.base for w in active.values()) + len(active)
    return ScaleUp(min(nodes, max_nodes), tuple(sorted(active)))
