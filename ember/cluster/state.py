"""The cluster controller's state, without Ray: live nodes' inventories, the model registry, placement.

The controller actor (`ember/cluster/actors.py`) holds one `ClusterState`; everything in it is rebuilt from
the nodes' reports (every node reports every `report_s`), so a restarted controller knows the cluster again
after one report round, and a node that stops reporting for `ttl_s` is dropped from the view. A start it cannot
place because every node is full asks for more machines through a `NodeScaler` (`ember/core/scale_up.py`
decides; Ray's autoscaler behind it, `ember/cluster/actors.py`).
"""

from __future__ import annotations

import logging
import secrets
import statistics
from dataclasses import dataclass
from typing import Literal, Protocol

from ember.cluster.chunks import ChunkBook
from ember.core.backlog import runnable, stranded, take_up
from ember.core.clock import Clock
from ember.core.min_scale import spread
from ember.core.placement import (
    ClusterSnapshot,
    Holding,
    ModelSpec,
    NodeSnapshot,
    Placed,
    Placement,
    Unplaceable,
    WarmInstance,
    check_fits,
    place,
)
from ember.core.rung_costs import RungCosts
from ember.core.scale_up import ScaleUp, Waiting, decide, found_no_room, placed
from ember.errors import ModelNotReady, ModelTooLarge
from ember.wire.cluster import ClusterView, NodeInventory
from ember.wire.contract import ModelContract

log = logging.getLogger("ember.cluster")

# The least time a node given a model to take up may take to deploy it (a cold LLM deploy here takes ~25 s; twice
# the placement's estimated time to ready where that is longer) before the model is taken as not coming.
TAKE_UP_S = 120.0


class NodeScaler(Protocol):
    """Asks for machines (Ray's autoscaler: `ember/cluster/actors.py` `RayScaler`; tests: `ember.testing.scaler`)."""

    def request_nodes(self, nodes: int) -> None:
        """Ask for the cluster to have `nodes` machines (replacing the last request); 0 withdraws it."""


@dataclass(frozen=True)
class ScaleSettings:
    hold_s: float = 120.0     # a model not seen without room this long stops waiting
    max_nodes: int = 64       # never ask for more (KubeRay's maxReplicas bounds it too)


def registry(inventories: tuple[NodeInventory, ...] | list[NodeInventory]) -> dict[str, ModelContract]:
    """Every model some node was given, by key (nodes given the same key are given the same contract)."""
    return {c.key: c for inv in sorted(inventories, key=lambda i: i.node) for c in inv.contracts}


def serves(inv: NodeInventory) -> bool:
    """The node has slices to serve on (a gateway only, `--cpu-slots 0`, has none)."""
    return any(inv.slices.values())


def refused(contracts: tuple[ModelContract, ...], nodes: tuple[NodeInventory, ...]) -> dict[str, str]:
    """The registered models no live node could hold even empty (`check_fits`): key -> the error, naming the
    model and the largest node. Deploying one is an InvalidInput, never an out-of-memory at run time. Only nodes
    with slices judge (a gateway only has none; with no such node, say a worker group at zero, nothing is
    refused: a node that joins may hold it)."""
    nodes = tuple(n for n in nodes if serves(n))
    if not nodes:
        return {}
    snaps = [NodeSnapshot(n.node, n.memory_mb, n.free_memory_mb, dict(n.slices), dict(n.free_slices), n.queue,
                          n.disk_bps, n.net_bps) for n in nodes]
    out = {}
    for c in contracts:
        try:
            check_fits(ModelSpec(c.key, 0, c.resources.memory_mb, c.resources.slice), snaps)
        except ModelTooLarge as err:
            out[c.key] = err.message
    return out


def to_snapshot(view: ClusterView, costs: RungCosts | None = None) -> ClusterSnapshot:
    """The pure placement's snapshot of a view: the same decision on the controller and on a gateway."""
    sizes: dict[str, int] = {}
    for inv in view.nodes:
        for h in inv.held:
            sizes[h.model] = max(sizes.get(h.model, 0), h.bytes)
    models = {c.key: ModelSpec(c.key, sizes.get(c.key, 0), c.resources.memory_mb, c.resources.slice)
              for c in view.contracts}
    disk, net = _measured(view.nodes, "disk"), _measured(view.nodes, "net")
    nodes = tuple(NodeSnapshot(
        inv.node, inv.memory_mb, inv.free_memory_mb, dict(inv.slices), dict(inv.free_slices), inv.queue,
        inv.disk_bps if "disk" in inv.measured else disk or inv.disk_bps,
        inv.net_bps if "net" in inv.measured else net or inv.net_bps,
        holdings={h.model: Holding(h.paused, h.template, h.local_bytes) for h in inv.held},
        warm=tuple(WarmInstance(w.id, inv.node, w.model, w.in_flight, w.max_concurrency) for w in inv.warm),
        origin_bps=inv.origin_bps, queue_s=inv.queue_s, serving=frozenset(inv.serving))
        for inv in view.nodes)
    # A node that has not fetched from the origin yet is costed at the best figure any node measured.
    origin = max((inv.origin_bps for inv in view.nodes if inv.origin_bps), default=view.origin_bps)
    return ClusterSnapshot(nodes, models, origin, view.service_s, costs or RungCosts())


def _measured(nodes: tuple[NodeInventory, ...], kind: Literal["disk", "net"]) -> float | None:
    """The median of the nodes' measured figures: what a node that has not measured its own is costed at (an
    assumed figure beside measured ones would favour or penalise it by the guess alone)."""
    figures = [inv.disk_bps if kind == "disk" else inv.net_bps for inv in nodes if kind in inv.measured]
    return statistics.median(figures) if figures else None


def without(snapshot: ClusterSnapshot, avoid: tuple[str, ...]) -> ClusterSnapshot:
    """The snapshot less some nodes (ones a gateway could not reach)."""
    if not avoid:
        return snapshot
    return ClusterSnapshot(tuple(n for n in snapshot.nodes if n.id not in avoid), snapshot.models,
                           snapshot.origin_bps, snapshot.service_s, snapshot.costs)


def _min_scales(view: ClusterView) -> dict[str, dict[str, int]]:
    """Each node's share of the min scale of every model it serves (`ember.core.min_scale`)."""
    wanted = {c.key: c.scaling.min_scale for c in view.contracts if c.scaling.min_scale > 0}
    if not wanted:
        return {}
    warm: dict[str, dict[str, int]] = {}
    for inv in view.nodes:
        for w in inv.warm:
            warm.setdefault(inv.node, {})[w.model] = warm.get(inv.node, {}).get(w.model, 0) + 1
    return spread(wanted, {inv.node: frozenset(inv.serving) for inv in view.nodes}, warm)


@dataclass(frozen=True)
class Holder:
    """A node holding every chunk of a model in its local tiers: where the store's peer tier can fetch from."""

    node: str
    url: str


@dataclass(frozen=True)
class Departure:
    """A node that left the view: why (Ray's GCS, its report timeout, its agent) and when (the state's clock)."""

    node: str
    cause: str
    at: float


class ClusterState:
    def __init__(self, clock: Clock, *, ttl_s: float = 3.0, origin_bps: float = 1e8, service_s: float = 0.05,
                 costs: RungCosts | None = None, token: str | None = None, scaler: NodeScaler | None = None,
                 scale: ScaleSettings = ScaleSettings()) -> None:
        self._clock, self._ttl_s = clock, ttl_s
        self._origin_bps, self._service_s, self._costs = origin_bps, service_s, costs
        self.token = token or secrets.token_urlsafe(24)
        self._nodes: dict[str, tuple[NodeInventory, float]] = {}
        self._pending: dict[str, int] = {}   # starts placed on a node since its last report
        self._started = clock.now()
        self.version = 0
        self.chunks = ChunkBook()   # origin leases and landed chunks of the weight stores' peer tier
        self._scaler, self._scale = scaler, scale
        self._waiting: dict[str, Waiting] = {}   # models that found every node full (ember/core/scale_up.py)
        # The contracts of nodes that left: a model whose nodes all left stays registered, so its queued jobs
        # and its next requests are placed on the nodes that remain (one a live node unloads is gone).
        self._orphans: dict[str, ModelContract] = {}
        # Models given to a node to take up: model key -> (node id, deadline). Kept while the node deploys it, so
        # that no second node is given it meanwhile; a deploy that has not landed by its deadline is taken as
        # failed and the model placed afresh.
        self._took: dict[str, tuple[str, float]] = {}
        self.asked = ScaleUp(0, ())              # the last request made of the scaler
        self.departed: tuple[Departure, ...] = ()   # the last nodes that left the view: which, why, when

    @property
    def complete(self) -> bool:
        """Every live node has reported since this state began: one ttl has passed (nodes report more often)."""
        return self._clock.now() - self._started >= self._ttl_s

    def report(self, inventory: NodeInventory) -> ClusterView:
        """Record a node's inventory (a new node joins the view) and answer the view."""
        if inventory.node not in self._nodes:
            self.version += 1
        self._nodes[inventory.node] = (inventory, self._clock.now())
        self._pending.pop(inventory.node, None)
        view = self.view()
        self._room_again(view)
        self._rescale()   # a wait past hold_s, or room again, withdraws the request
        return view

    def _room_again(self, view: ClusterView) -> None:
        """Models waiting for room that a node serving them can now run (a new node deployed it, or room came
        free), or that some node serves with none of their jobs left queued (the job that asked ran, and nothing
        waits now), wait no more: the request for machines shrinks or is withdrawn then, not `hold_s` later
        (while it stands, Ray's autoscaler keeps the machines it counts, idle or not). Not sooner (a node that
        could merely start it): the node that joined for it must be deploying or running it, and so hold its Ray
        bundle (`ember/cluster/busy.py`), before the request stops keeping it. A request that then finds no room
        waits again."""
        if not self._waiting or not view.complete:
            return
        snapshot = to_snapshot(view, self._costs)
        serving = {inv.node: frozenset(inv.serving) for inv in view.nodes}
        for model in list(self._waiting):
            served = any(model in models for models in serving.values())
            queued = max((inv.jobs.get(model, 0) for inv in view.nodes), default=0)
            if model in snapshot.models and (runnable(model, snapshot, serving) or (served and not queued)):
                self._waiting = placed(self._waiting, model)

    def remove(self, node: str, cause: str = "removed") -> bool:
        """Drop a node at once (its agent died, Ray's GCS says it is dead); False when it was not in the view."""
        self._pending.pop(node, None)
        self.chunks.forget(node)
        gone = self._nodes.pop(node, None)
        if gone is None:
            return False
        self._orphans.update({c.key: c for c in gone[0].contracts})
        self.version += 1
        self.departed = (*self.departed[-31:], Departure(node, cause, self._clock.now()))
        log.warning("cluster: node %s left the view (%s)", node, cause)
        return True

    def expire(self) -> list[str]:
        """Drop the nodes that have not reported for `ttl_s`; their ids."""
        now = self._clock.now()
        gone = [n for n, (_, seen) in self._nodes.items() if now - seen > self._ttl_s]
        for node in gone:
            self.remove(node, f"no report for {self._ttl_s:g} s")
        return gone

    def view(self) -> ClusterView:
        self.expire()
        nodes = tuple(self._queued(inv) for inv, _ in sorted(self._nodes.values(), key=lambda x: x[0].node))
        live = registry(nodes)
        for key in live:
            self._orphans.pop(key, None)
        contracts = (*live.values(), *(c for _, c in sorted(self._orphans.items())))
        view = ClusterView(version=self.version, nodes=nodes, contracts=contracts, refused=refused(contracts, nodes),
                           origin_bps=self._origin_bps, service_s=self._service_s, token=self.token,
                           complete=self.complete)
        if not view.complete:
            return view
        return view.model_copy(update={"take_up": self._take_up(view), "min_scale": _min_scales(view)})

    def _take_up(self, view: ClusterView) -> dict[str, tuple[str, ...]]:
        """Which node deploys which model whose queued jobs no node serving it can run (`ember.core.backlog`)."""
        queued: dict[str, int] = {}
        for inv in view.nodes:   # a shared store: every node sees the same queue, a moment apart
            for model, jobs in inv.jobs.items():
                queued[model] = max(queued.get(model, 0), jobs)
        if not any(queued.values()):
            self._took = {}
            return {}
        now = self._clock.now()
        given = {model: node for model, (node, until) in self._took.items() if now < until}
        for model, (node, _) in self._took.items():
            if model not in given:
                log.warning("cluster: node %s has not deployed %s it was given to take up in time: placed afresh",
                            node, model)
        snapshot, serving = to_snapshot(view, self._costs), {inv.node: frozenset(inv.serving) for inv in view.nodes}
        decided = take_up(snapshot, queued, serving, given)
        for model in stranded(snapshot, queued, serving, decided):   # queued jobs are demand for a machine
            if model not in view.refused:
                self._waiting = found_no_room(self._waiting, model, now, self._serving_nodes())
        out: dict[str, tuple[str, ...]] = {}
        took: dict[str, tuple[str, float]] = {}
        for t in decided:
            out[t.node] = (*out.get(t.node, ()), t.model)
            if given.get(t.model) == t.node:
                took[t.model] = self._took[t.model]
                continue
            # A deploy has until twice its estimated time to ready, at least TAKE_UP_S (a large model's fetch).
            took[t.model] = (t.node, now + max(TAKE_UP_S, 2 * (t.placed.ready_s if t.placed else 0.0)))
            log.info("cluster: node %s takes up %s (%d queued job(s), no node serving it can run them)",
                     t.node, t.model, t.jobs)
        self._took = took
        return out

    def _queued(self, inv: NodeInventory) -> NodeInventory:
        # A start placed since the node last reported counts as queued there: two gateways asking at once
        # are not both sent to the same empty node as if the other had not asked.
        extra = self._pending.get(inv.node, 0)
        if extra == 0:
            return inv
        queue_s = None if inv.queue_s is None else inv.queue_s + extra * self._service_s   # as one more request
        return inv.model_copy(update={"queue": inv.queue + extra, "queue_s": queue_s})

    def place(self, model: str, avoid: tuple[str, ...] = (), here: str | None = None) -> Placement:
        """Where `model` would be ready soonest, of the live nodes but `avoid` (ties: `here`, the asking node);
        Unplaceable for an unknown model. Rebuilding raises ModelNotReady: the asking gateway places on its own last
        view meanwhile."""
        if not self.complete:
            raise ModelNotReady("the cluster controller is rebuilding its view from the nodes' reports")
        view = self.view()
        if model in view.refused:
            raise ModelTooLarge(view.refused[model])
        snapshot = to_snapshot(view, self._costs)
        if model not in snapshot.models:
            return Unplaceable(model, f"model '{model}': no node of the cluster was given it")
        placement = place(model, without(snapshot, avoid), here)
        if isinstance(placement, Placed):
            self.note_start(placement.node)
            self._waiting = placed(self._waiting, model)
        elif placement.for_room and not avoid:   # a node a gateway could not reach is not a full cluster
            self._waiting = found_no_room(self._waiting, model, self._clock.now(), self._serving_nodes())
        self._rescale()
        return placement

    def _serving_nodes(self) -> int:
        """Nodes that could serve (with slices): the machines the autoscaler counts; a gateway only is none."""
        return sum(1 for inv, _ in self._nodes.values() if serves(inv))

    def _rescale(self) -> None:
        """Ask the scaler for the size `decide` gives, when it differs from the last request made."""
        if self._scaler is None:
            return
        wanted = decide(self._waiting, self._clock.now(), hold_s=self._scale.hold_s, max_nodes=self._scale.max_nodes)
        if wanted.nodes == self.asked.nodes:
            self.asked = wanted   # the same size, perhaps for other models
            return
        try:
            self._scaler.request_nodes(wanted.nodes)
        except Exception as err:   # the autoscaler's errors: asked again at the next change
            log.warning("cluster: asking for %d node(s) failed (%s: %s)", wanted.nodes, type(err).__name__, err)
            return
        log.info("cluster: asked for %d node(s) (waiting for room: %s)", wanted.nodes, ", ".join(wanted.models))
        self.asked = wanted

    def note_start(self, node: str) -> None:
        """A start placed on `node` (here, or by a gateway on its own view): queued there until it reports."""
        if node in self._nodes:
            self._pending[node] = self._pending.get(node, 0) + 1

    def nodes(self) -> dict[str, str]:
        """Live node id -> gateway URL."""
        return {inv.node: inv.url for inv, _ in self._nodes.values()}

    def chunk_holders(self, digest: str, store_models: tuple[str, ...], asking: str) -> list[str]:
        """Gateway URLs of the live nodes but `asking` holding a chunk: those that landed it under a lease, then
        those holding every chunk of a model whose weights are one of `store_models` (store `name:version`)."""
        self.expire()
        landed = self.chunks.landed(digest)
        full = self._whole(store_models)
        ordered = sorted(landed, key=lambda n: (n not in full, n)) + sorted(full - landed)
        return [self._nodes[n][0].url for n in ordered if n != asking and n in self._nodes]

    def model_holders(self, store_models: tuple[str, ...], asking: str) -> list[str]:
        """Gateway URLs of the live nodes but `asking` holding every chunk of one of `store_models`."""
        self.expire()
        return [self._nodes[n][0].url for n in sorted(self._whole(store_models)) if n != asking]

    def _whole(self, store_models: tuple[str, ...]) -> set[str]:
        keys = {c.key for inv, _ in self._nodes.values() for c in inv.contracts if c.store_ref in store_models}
        return {h.node for key in keys for h in self.holders(key)}

    def holders(self, model: str) -> list[Holder]:
        """The nodes holding all of `model`'s chunks locally (the hook the weight store's peer tier asks)."""
        out = []
        for inv, _ in sorted(self._nodes.values(), key=lambda x: x[0].node):
            held = next((h for h in inv.held if h.model == model), None)
            if held is not None and held.bytes > 0 and held.local_bytes >= held.bytes:
                out.append(Holder(inv.node, inv.url))
        return out
