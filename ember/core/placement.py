"""Placement across nodes by estimated time to ready, and routing among warm instances (power of two choices).

The cluster's counterpart of `ember.core.scheduler` (which walks one node's ladder). Given a snapshot of
every node, `place(model, snapshot)` picks the node where the model would be ready soonest: per node, the
cheapest rung it has for the model plus the time to work through that node's queue.

    rung      when                                       start cost (seconds)
    paused    the node holds a paused instance           costs.paused.start_s (it keeps its memory and slice)
    template  the node holds the model's template         costs.template.start_s
    zygote    every chunk is local                        costs.zygote.start_s + bytes / disk_bps
    fetch     chunks are missing: from a peer that holds  costs.zygote.start_s + bytes / disk_bps
              them all, else from the origin               + missing / (net_bps, or min(net_bps, origin_bps))
              (fetched chunks land on disk and are then loaded like local ones: never cheaper than local)

The bandwidths are each node's measured figures (`ember.core.bandwidth`): disk_bps its disk tier's reads,
net_bps its fetches from peers, origin_bps its fetches from the origin where it has made some (else the
snapshot's: the best any node measured, else an assumed figure).

    ready_s = start_s + queue_s   (the node's waiting requests over the rates it measured its models served at
                                   lately; queue * service_s where it measured none)

Every rung but paused starts a new instance, so it needs the model's memory free on the node and a free
slice of the model's kind; a node offering neither and holding no paused instance is never chosen.
Ties go to the cheaper rung, then to the asking gateway's own node (`here`: no forward, whose round trip
costs 1-2 ms of a ~12 ms template start on this machine's VMs, bench/cluster.py), then to the node whose id
sorts first, so a decision is a function of the snapshot and the asker alone. A model no node could ever hold
(too little memory, or no slice of its kind, on every node even when empty) is `check_fits`'s error at
deploy, not an out-of-memory at run time.

Decisions are vectorised over nodes (numpy): a `ClusterView`, built once per snapshot (the snapshot
caches it), answers each `place` in a few tens of microseconds with 100 nodes (bench/placement.py).
`estimate` is the same rule for one node in plain Python: the reference the tests hold the view to.

`pick_warm` routes a request among the model's warm instances across nodes as Ray Serve does: two
instances with room drawn at random (an injected, seeded `random.Random`), the less loaded wins; a
node's own instances first when it has any with room.

`route` is a gateway's whole decision for one request, in order: a local hot instance with room, else a
remote warm one (`pick_warm`), else ask the controller to start one (`place`, on its fresher snapshot);
`after_placement` turns the controller's answer into serve here, forward there, or a durable job.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import numpy as np

from ember.core.rung_costs import RungCosts
from ember.core.states import Rung
from ember.errors import InvalidInput, ModelTooLarge

__all__ = [
    "AskController",
    "ClusterSnapshot",
    "ClusterView",
    "Enqueue",
    "Forward",
    "Holding",
    "ModelSpec",
    "NodeSnapshot",
    "Placed",
    "Placement",
    "Route",
    "ServeHere",
    "Unplaceable",
    "WarmInstance",
    "WeightSource",
    "after_placement",
    "check_fits",
    "estimate",
    "pick_warm",
    "place",
    "route",
]

WeightSource = Literal["local", "peer", "origin"]


def _at_least(where: str, value: float, low: float = 0.0, strict: bool = False) -> None:
    ok = value > low if strict else value >= low
    if not (ok and math.isfinite(value)):
        raise InvalidInput(f"{where}: must be {'>' if strict else '>='} {low:g}, got {value!r}")


@dataclass(frozen=True)
class ModelSpec:
    key: str             # "name:version"
    bytes: int           # the weights' total size
    memory_mb: int       # what one instance needs
    slice_kind: str = "cpu"

    def __post_init__(self) -> None:
        _at_least(f"model {self.key}: bytes", self.bytes)
        _at_least(f"model {self.key}: memory_mb", self.memory_mb)


@dataclass(frozen=True)
class Holding:
    """What one node has of one model."""

    paused: int = 0          # paused instances (each holds its memory and slice)
    template: bool = False
    local_bytes: int = 0     # bytes of the model's chunks in the node's local tiers

    def __post_init__(self) -> None:
        _at_least("holding: paused", self.paused)
        _at_least("holding: local_bytes", self.local_bytes)


@dataclass(frozen=True)
class WarmInstance:
    id: str
    node: str
    model: str
    in_flight: int
    max_concurrency: int

    @property
    def room(self) -> bool:
        return self.in_flight < self.max_concurrency


@dataclass(frozen=True)
class NodeSnapshot:
    id: str
    memory_mb: int                     # total (what an empty node could give): `check_fits`
    free_memory_mb: int
    slices: Mapping[str, int]          # slices per kind, in all
    free_slices: Mapping[str, int]     # slices per kind nobody holds now
    queue: int                         # requests waiting on this node
    disk_bps: float                    # measured local read bandwidth, bytes/s
    net_bps: float                     # measured network bandwidth (fetches from peers), bytes/s
    holdings: Mapping[str, Holding] = field(default_factory=dict)   # by model key
    warm: tuple[WarmInstance, ...] = ()
    origin_bps: float | None = None    # measured from the origin to this node; None: the snapshot's figure
    queue_s: float | None = None       # seconds to work through `queue` at the node's measured rates
    serving: frozenset[str] = frozenset()   # the models deployed here: its ladder waits for their room

    def __post_init__(self) -> None:
        for name in ("memory_mb", "free_memory_mb", "queue"):
            _at_least(f"node {self.id}: {name}", getattr(self, name))
        if self.queue_s is not None:
            _at_least(f"node {self.id}: queue_s", self.queue_s)
        _at_least(f"node {self.id}: disk_bps", self.disk_bps, strict=True)
        _at_least(f"node {self.id}: net_bps", self.net_bps, strict=True)
        if self.origin_bps is not None:
            _at_least(f"node {self.id}: origin_bps", self.origin_bps, strict=True)

    def queue_wait_s(self, service_s: float) -> float:
        """The queue ahead of a start here: as the node measured it, else `service_s` per waiting request."""
        return self.queue * service_s if self.queue_s is None else self.queue_s


@dataclass(frozen=True)
class ClusterSnapshot:
    nodes: tuple[NodeSnapshot, ...]
    models: Mapping[str, ModelSpec]     # by key
    origin_bps: float                   # the origin's bandwidth to a node that has not measured its own, bytes/s
    service_s: float                    # estimated seconds per queued request
    costs: RungCosts = field(default_factory=RungCosts)   # measured: RungCosts.from_benchmark

    def __post_init__(self) -> None:
        _at_least("origin_bps", self.origin_bps, strict=True)
        _at_least("service_s", self.service_s)
        ids = [n.id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise InvalidInput("nodes: node ids must be unique")

    @cached_property
    def view(self) -> ClusterView:
        """The vectorised view, built on first use (cached_property writes past the frozen dataclass)."""
        return ClusterView(self)

    def spec(self, model: str) -> ModelSpec:
        try:
            return self.models[model]
        except KeyError:
            raise InvalidInput(f"model '{model}': not in the cluster snapshot") from None


@dataclass(frozen=True)
class Placed:
    model: str
    node: str
    rung: Rung                          # PAUSED, TEMPLATE, ZYGOTE or FETCH
    weights: WeightSource | None        # where a zygote start reads the chunks from (None: it needs none)
    start_s: float                      # the rung's estimated start
    queue_s: float                      # the node's queue ahead of it

    @property
    def ready_s(self) -> float:
        return self.start_s + self.queue_s


@dataclass(frozen=True)
class Unplaceable:
    model: str
    reason: str
    for_room: bool = False   # every node is full (a new node would help), not: unknown model, no view


Placement = Placed | Unplaceable

_NO_HOLDING = Holding()
_RUNG_ORDER = {Rung.PAUSED: 0, Rung.TEMPLATE: 1, Rung.ZYGOTE: 2, Rung.FETCH: 3}


def _fits(spec: ModelSpec, node: NodeSnapshot) -> bool:
    return node.free_memory_mb >= spec.memory_mb and node.free_slices.get(spec.slice_kind, 0) > 0


def estimate(spec: ModelSpec, node: NodeSnapshot, snapshot: ClusterSnapshot) -> Placed | None:
    """The cheapest rung this node has for the model, with its time to ready; None when it has none."""
    held = node.holdings.get(spec.key, _NO_HOLDING)
    queue_s = node.queue_wait_s(snapshot.service_s)
    costs = snapshot.costs
    if held.paused > 0:
        return Placed(spec.key, node.id, Rung.PAUSED, None, costs.paused.start_s, queue_s)
    if not _fits(spec, node):
        return None
    if held.template:
        return Placed(spec.key, node.id, Rung.TEMPLATE, None, costs.template.start_s, queue_s)
    local = min(held.local_bytes, spec.bytes)
    missing = spec.bytes - local
    start = costs.zygote.start_s + spec.bytes / node.disk_bps
    if missing == 0:
        return Placed(spec.key, node.id, Rung.ZYGOTE, "local", start, queue_s)
    peer = any(n.id != node.id and n.holdings.get(spec.key, _NO_HOLDING).local_bytes >= spec.bytes
               for n in snapshot.nodes)
    bps = node.net_bps if peer else min(node.net_bps, node.origin_bps or snapshot.origin_bps)
    return Placed(spec.key, node.id, Rung.FETCH, "peer" if peer else "origin", start + missing / bps, queue_s)


def _best(placed: list[Placed], here: str | None = None) -> Placed | None:
    return min(placed, key=lambda p: (p.ready_s, _RUNG_ORDER[p.rung], p.node != here, p.node), default=None)


def place(model: str, snapshot: ClusterSnapshot, here: str | None = None) -> Placement:
    """Where `model` would be ready soonest (vectorised over the snapshot's nodes); `here`: the asking node."""
    return snapshot.view.place(model, here)


def place_slowly(model: str, snapshot: ClusterSnapshot, here: str | None = None) -> Placement:
    """`place` one node at a time in plain Python: the reference (and the bench's baseline)."""
    spec = snapshot.spec(model)
    best = _best([p for n in snapshot.nodes if (p := estimate(spec, n, snapshot)) is not None], here)
    return best if best is not None else _unplaceable(spec, len(snapshot.nodes))


def _unplaceable(spec: ModelSpec, nodes: int) -> Unplaceable:
    return Unplaceable(spec.key, f"model '{spec.key}': none of {nodes} node(s) has {spec.memory_mb} MB free and a "
                                 f"free '{spec.slice_kind}' slice, or a paused instance of it", for_room=True)


class ClusterView:
    """A snapshot as arrays (nodes by id; models by row), so each decision is a few numpy operations."""

    def __init__(self, snapshot: ClusterSnapshot) -> None:
        self.snapshot = snapshot
        nodes = sorted(snapshot.nodes, key=lambda n: n.id)   # index order is the tie-break
        self.node_ids = [n.id for n in nodes]
        self._row = {key: i for i, key in enumerate(snapshot.models)}
        n, m = len(nodes), len(self._row)
        self._free_mb = np.array([x.free_memory_mb for x in nodes], dtype=np.float64)
        self._queue_s = np.array([x.queue_wait_s(snapshot.service_s) for x in nodes], dtype=np.float64)
        self._disk = np.array([x.disk_bps for x in nodes], dtype=np.float64)
        self._net = np.array([x.net_bps for x in nodes], dtype=np.float64)
        self._origin = np.minimum(self._net, [x.origin_bps or snapshot.origin_bps for x in nodes])
        kinds = {k for x in nodes for k in x.free_slices}
        self._free_slices = {k: np.array([x.free_slices.get(k, 0) > 0 for x in nodes]) for k in kinds}
        self._none = np.zeros(n, dtype=bool)
        self._paused = np.zeros((m, n), dtype=bool)
        self._template = np.zeros((m, n), dtype=bool)
        self._local = np.zeros((m, n), dtype=np.float64)
        self._warm: dict[str, list[WarmInstance]] = {}
        for j, node in enumerate(nodes):
            for key, held in node.holdings.items():
                if (i := self._row.get(key)) is not None:
                    self._paused[i, j], self._template[i, j] = held.paused > 0, held.template
                    self._local[i, j] = held.local_bytes
            for w in node.warm:
                self._warm.setdefault(w.model, []).append(w)
        size = np.array([s.bytes for s in snapshot.models.values()], dtype=np.float64)
        np.minimum(self._local, size[:, None], out=self._local)
        self._full = self._local >= size[:, None]
        self._holders = self._full.sum(axis=1)

    def place(self, model: str, here: str | None = None) -> Placement:
        spec = self.snapshot.spec(model)
        i, costs = self._row[model], self.snapshot.costs
        fits = (self._free_mb >= spec.memory_mb) & self._free_slices.get(spec.slice_kind, self._none)
        local, full = self._local[i], self._full[i]
        peer = (self._holders[i] - full) > 0     # another node holds every chunk
        fetch_bps = np.where(peer, self._net, self._origin)
        start = costs.zygote.start_s + spec.bytes / self._disk + (spec.bytes - local) / fetch_bps
        start = np.where(fits, start, np.inf)
        start = np.where(fits & self._template[i], costs.template.start_s, start)
        start = np.where(self._paused[i], costs.paused.start_s, start)
        ready = start + self._queue_s
        if not len(ready):   # no node (a gateway avoiding the only one it could not reach)
            return _unplaceable(spec, 0)
        j = int(np.argmin(ready))
        if not math.isfinite(ready[j]):
            return _unplaceable(spec, len(self.node_ids))
        ties = np.flatnonzero(ready == ready[j])
        if len(ties) > 1:   # the cheaper rung, then `here`, then the first id (argmin keeps the first of equals)
            order = np.where(self._paused[i, ties], 0, np.where(self._template[i, ties] & fits[ties], 1,
                                                                  np.where(full[ties], 2, 3)))
            elsewhere = np.array([self.node_ids[t] != here for t in ties])
            j = int(ties[np.argmin(order * 2 + elsewhere)])
        return self._placed(spec, i, j, bool(fits[j]), bool(peer[j]), float(start[j]))

    def _placed(self, spec: ModelSpec, i: int, j: int, fits: bool, peer: bool, start_s: float) -> Placed:
        node, queue_s = self.node_ids[j], float(self._queue_s[j])
        if self._paused[i, j]:
            return Placed(spec.key, node, Rung.PAUSED, None, start_s, queue_s)
        if fits and self._template[i, j]:
            return Placed(spec.key, node, Rung.TEMPLATE, None, start_s, queue_s)
        if self._full[i, j]:
            return Placed(spec.key, node, Rung.ZYGOTE, "local", start_s, queue_s)
        return Placed(spec.key, node, Rung.FETCH, "peer" if peer else "origin", start_s, queue_s)

    def route(self, model: str, rng: random.Random, local_node: str | None = None) -> WarmInstance | None:
        """A warm instance of `model` with room (power of two choices), or None: then `place` starts one."""
        return pick_warm(self._warm.get(model, ()), rng, local_node)


def pick_warm(instances: Sequence[WarmInstance], rng: random.Random,
              local_node: str | None = None) -> WarmInstance | None:
    """Of the instances with room (on `local_node` when it has any), the less loaded of two drawn at random.

    Load is the share of its concurrency in use; equal loads go to the fewer requests, then the first
    (node, id), so a seeded `rng` makes the pick reproducible."""
    open_ = [w for w in instances if w.room]
    if local_node is not None:
        mine = [w for w in open_ if w.node == local_node]
        open_ = mine or open_
    if len(open_) <= 1:
        return open_[0] if open_ else None
    a, b = rng.sample(open_, 2)
    return min(a, b, key=lambda w: (w.in_flight / w.max_concurrency, w.in_flight, w.node, w.id))


def check_fits(model: ModelSpec, nodes: Sequence[NodeSnapshot]) -> None:
    """ModelTooLarge unless some node, empty, could hold one instance: its memory and a slice of its kind."""
    if any(n.memory_mb >= model.memory_mb and n.slices.get(model.slice_kind, 0) > 0 for n in nodes):
        return
    if not nodes:
        raise ModelTooLarge(f"model '{model.key}': the cluster has no node")
    with_kind = [n for n in nodes if n.slices.get(model.slice_kind, 0) > 0]
    largest = max(with_kind or nodes, key=lambda n: (n.memory_mb, n.id))
    kinds = ", ".join(f"{k}×{v}" for k, v in sorted(largest.slices.items()) if v > 0) or "none"
    if not with_kind:
        raise ModelTooLarge(f"model '{model.key}': needs a '{model.slice_kind}' slice and no node has one; the "
                            f"largest node, {largest.id}, has {largest.memory_mb} MB and slices {kinds}")
    raise ModelTooLarge(f"model '{model.key}': needs {model.memory_mb} MB on a '{model.slice_kind}' slice; the "
                        f"largest node with one, {largest.id}, has {largest.memory_mb} MB (slices {kinds})")


# ----- a gateway's decision for one request --------------------------------------------------------


@dataclass(frozen=True)
class ServeHere:
    """The local node serves it: it has a hot instance with room, or the controller placed the start here."""

    why: Literal["local hot", "local warm", "placed here", "served here"]


@dataclass(frozen=True)
class Forward:
    """Another node's gateway serves it: a warm instance there, or the controller placed the start there."""

    node: str
    why: Literal["remote warm", "placed there", "served there"]


@dataclass(frozen=True)
class AskController:
    """No warm instance with room anywhere the snapshot knows: the controller places a start."""


@dataclass(frozen=True)
class Enqueue:
    """Nowhere to start one: the request becomes a durable job (any node serving the model claims it)."""

    reason: str


Route = ServeHere | Forward | AskController


def route(model: str, snapshot: ClusterSnapshot, rng: random.Random, local_node: str, local_room: bool) -> Route:
    """Local hot first (`local_room`: the local node's live pool has an instance of `model` with room, which a
    snapshot may not know yet), else a warm instance with room by power of two choices (the local node's
    first), else the controller."""
    if local_room:
        return ServeHere("local hot")
    if model not in snapshot.models:
        return AskController()
    warm = snapshot.view.route(model, rng, local_node)
    if warm is None:
        return AskController()
    return ServeHere("local warm") if warm.node == local_node else Forward(warm.node, "remote warm")


def after_placement(placement: Placement, local_node: str, served_here: bool = False,
                    snapshot: ClusterSnapshot | None = None) -> ServeHere | Forward | Enqueue:
    """The controller's placement as this gateway's next step. Nowhere to start one, but the model is deployed
    on this node (`served_here`): its own ladder waits for room or makes the job itself, as on one node (never a
    job while a slot frees here in a moment, nor while a restarting controller's view does not list the model).
    Deployed on other nodes of `snapshot` instead: forwarded to the least queued of them, whose ladder does the
    same: a view is a report or two old, and an instance it shows starting or busy may have room by now (a caller
    that polls its job to success and asks again at once is not made a job while the node that ran it is idle)."""
    if isinstance(placement, Unplaceable):
        if served_here:
            return ServeHere("served here")
        there = _serving(placement.model, snapshot, local_node)
        return Forward(there, "served there") if there is not None else Enqueue(placement.reason)
    return ServeHere("placed here") if placement.node == local_node else Forward(placement.node, "placed there")


def _serving(model: str, snapshot: ClusterSnapshot | None, local_node: str) -> str | None:
    """Of the other nodes with `model` deployed, the one with the shortest queue (then the first id)."""
    if snapshot is None:
        return None
    nodes = [n for n in snapshot.nodes if model in n.serving and n.id != local_node]
    best = min(nodes, key=lambda n: (n.queue_wait_s(snapshot.service_s), n.id), default=None)
    return None if best is None else best.id
