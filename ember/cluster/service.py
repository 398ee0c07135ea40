"""The gateway's `Service` on a node of a cluster: the local serving controller, plus routing across nodes.

    request ─▶ local hot instance with room?              serve here (the local ladder, as on one node)
             ─▶ a warm instance with room on some node?   power of two choices: here, or forward over HTTP
             ─▶ ask the controller (Ray) to place a start: here (deploy here, then the local ladder) or forward
             ─▶ nowhere to start one                      a durable job (the shared store: a node serving
                                                          the model claims it)

The decision is `ember.core.placement.route` / `after_placement` (pure); this module carries it out.
Streams are routed the same way (a stream never becomes a job). Request data goes gateway to gateway over
HTTP (`forward.py`; mutual TLS with `--tls-dir`), never through Ray, as the caller's request (its API key,
tenant and trace context: `ember.gateway.caller`), which the serving node admits itself. A forwarded request
whose node never took it (`NotDelivered`: not reached, or reset with the request unread) is sent once elsewhere;
one its node may have read and was lost with (`NodeUnreachable`: closed, cut off, silent, or gone from the
view) answers 502 naming why,
and is run again elsewhere only when its contract says `idempotent: true` (it may have run there). Either way
that node leaves this gateway's view until the controller lists it again. A stream follows the same rule
until its first reply came (after it, a failure ends it with an error event).

The view comes from a report loop (`run`): every `report_s` this node sends its inventory to the
controller and gets the cluster's view back; a node Ray's GCS declares dead leaves it at once (`watch`). With
the controller away (restarting) the node keeps serving on its last view, and places starts on it itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ember.cluster.forward import Forwarder
from ember.cluster.inventory import inventory
from ember.cluster.state import to_snapshot, without
from ember.core.placement import (
    AskController,
    ClusterSnapshot,
    Enqueue,
    Forward,
    Placed,
    Placement,
    ServeHere,
    Unplaceable,
    after_placement,
    place,
    route,
)
from ember.errors import EmberError, ModelNotFound, ModelTooLarge, NodeUnreachable, NotDelivered, Overloaded
from ember.gateway.caller import forwarded_headers
from ember.serving.controller import Controller
from ember.serving.results import (
    InferResult,
    InferStream,
    JobAccepted,
    JobStatus,
    ModelStatus,
    OnClaim,
    RepositoryEntry,
    WhenFull,
)
from ember.wire.cluster import ClusterView, NodeInventory
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

log = logging.getLogger("ember.cluster")


class ClusterLink(Protocol):
    """What a node asks of the cluster controller (a Ray actor behind it: `ember/cluster/actors.py`)."""

    async def report(self, inventory: NodeInventory) -> ClusterView: ...

    async def place(self, model: str, avoid: tuple[str, ...], here: str | None = None) -> Placement: ...

    def placed(self, placement: Placed) -> None:
        """Tell the controller of a start this gateway placed on its own view (without waiting for an answer)."""

    async def gone(self, seen: int) -> tuple[int, tuple[str, ...]]:
        """A long poll: (how many nodes Ray's GCS has declared dead, those after the first `seen`), answered as
        soon as there is one (`seen` < 0: the count, at once)."""


@dataclass(frozen=True)
class ClusterSettings:
    node_id: str
    url: str                      # this node's gateway, as the other nodes reach it
    report_s: float = 0.5
    place_timeout_s: float = 1.0  # past it, the node places on its own last view
    fresh_s: float = 1.0          # a complete view this recent: starts are placed on it, the controller told after
    tell_after_s: float = 0.05    # ... told only of a start not answered by then (a template fork is ~10 ms)
    disk_bps: float = 1e9         # assumed until the node's store has measured its own (cluster/inventory.py)
    net_bps: float = 1.25e9
    seed: int = 14
    stream_retry_s: float = 1.0   # Retry-After of a stream no node has room for (a stream never becomes a job)
    service_s: float = 0.05       # per waiting request of a model not measured yet, until a view gives the figure


class ClusterService:
    def __init__(self, local: Controller, link: ClusterLink, forwarder: Forwarder, settings: ClusterSettings,
                 rng: random.Random | None = None) -> None:
        self._local, self._link, self._forwarder, self._s = local, link, forwarder, settings
        self._rng = rng or random.Random(settings.seed)
        self._view: ClusterView | None = None
        self._view_at = float("-inf")   # the event loop's time of the last view the controller answered
        self._snapshot: ClusterSnapshot | None = None
        self._registry: dict[str, ModelContract] = {}
        self._deploying: dict[str, asyncio.Task[None]] = {}
        self.forwarded = 0            # requests this gateway sent to another node
        self.retried = 0              # of those, sent again elsewhere after their node went away
        self.lost = 0                 # of those, taken by a node lost before it answered, not run again (502)

    # ----- the view ------------------------------------------------------------------------

    async def run(self) -> None:
        """Report this node's inventory and take the cluster's view, every `report_s`, until cancelled."""
        while True:
            try:
                await self.report_once()
            except Exception as err:   # Ray's errors while the controller restarts: serve on the last view
                log.warning("cluster: report failed (%s: %s); serving on the last view", type(err).__name__, err)
            await asyncio.sleep(self._s.report_s)

    async def watch(self) -> None:
        """Drop each node Ray's GCS declares dead as soon as the controller reads it (`ClusterLink.gone`), not at
        the next report (up to `report_s` later); what waits on it there is cut. Returns when this node itself is
        declared dead (fenced: Ray ends its raylet and the controller takes no more of its reports)."""
        seen = -1
        while True:
            try:
                seen, nodes = await self._link.gone(seen)
            except Exception as err:   # the controller restarting: the reports still bring the view
                log.warning("cluster: waiting for dead nodes failed (%s: %s)", type(err).__name__, err)
                await asyncio.sleep(self._s.report_s)
                continue
            if self._s.node_id in nodes:
                return
            for node in nodes:
                self._drop(node)

    async def report_once(self) -> None:
        mine = inventory(self._local, self._s.node_id, self._s.url, self._registry.values(),
                         given=self._local.offered(), disk_bps=self._s.disk_bps, net_bps=self._s.net_bps,
                         service_s=self._s.service_s if self._view is None else self._view.service_s)
        view = await self._link.report(mine)
        # An incomplete view (a restarted controller that has not heard from every node) would drop nodes that
        # are there: keep the last complete one until it is complete.
        if view.complete or self._view is None:
            self._set_view(view)
            if view.complete:
                self._view_at = asyncio.get_running_loop().time()
        self._take_up(view.take_up.get(self._s.node_id, ()))
        for key, share in view.min_scale.get(self._s.node_id, {}).items():
            self._local.set_min_scale(key, share)

    def _take_up(self, models: tuple[str, ...]) -> None:
        """Deploy the models the controller gave this node to take up (their queued jobs no node serving them
        can run, `ember.core.backlog`): the job runner claims them once the model is here."""
        for key in models:
            contract = self._registry.get(key)
            # Not one deployed here or under way: `--models` deploys at startup without `_deploying`.
            if contract is not None and not self._local.has_deployment(key) and key not in self._deploying:
                log.info("cluster: taking up %s for its queued jobs", key)
                self._deploy_task(contract)

    def _set_view(self, view: ClusterView, cut: bool = True) -> None:
        """`cut`: end the requests and streams waiting on the nodes it lacks (else they end on their own)."""
        before = {n.url for n in self._view.nodes} if self._view is not None else set()
        left = before - {n.url for n in view.nodes}
        for url in left if cut else ():
            if ended := self._forwarder.cut(url):
                log.warning("cluster: node %s left the view: %d request(s) and stream(s) waiting there end", url,
                            ended)
        self._view, self._snapshot = view, to_snapshot(view)
        self._registry = {c.key: c for c in view.contracts}

    def _drop(self, node: str, cut: bool = True) -> None:
        """A node that could not be reached leaves this gateway's view until the controller's next answer.
        `cut=False` when its machine answered (refused, reset, closed): every request waiting there gets an answer
        of its own in a moment, which says whether it was delivered (a reset: not, and it goes elsewhere); cut,
        they would all count as taken. A machine fallen silent answers none: they are cut."""
        if self._view is not None:
            self._set_view(self._view.model_copy(update={"nodes": tuple(n for n in self._view.nodes
                                                                          if n.node != node)}), cut)

    def _url(self, node: str) -> str:
        for inv in self._view.nodes if self._view is not None else ():
            if inv.node == node:
                return inv.url
        raise NotDelivered(f"node {node} is not in this gateway's view")

    # ----- Service: models -------------------------------------------------------------------

    def contracts(self) -> list[ModelContract]:
        return list({**self._registry, **{c.key: c for c in self._local.contracts()}}.values())

    def contract(self, name: str, version: str | None = None) -> ModelContract:
        try:
            return self._local.contract(name, version)
        except ModelNotFound:
            found = [c for c in self._registry.values() if c.name == name and version in (None, c.version)]
            if not found:
                raise
            return max(found, key=lambda c: (len(c.version), c.version))

    def model_ready(self, name: str, version: str | None = None) -> bool:
        if self._local.model_ready(name, version):
            return True
        return any(c.name == name and version in (None, c.version) for c in self._registry.values())

    def server_ready(self) -> bool:
        """A node given models: once they are (as on one node). A node given none: once it has joined and the
        cluster has some model to forward to."""
        if self._local.has_models():
            return self._local.server_ready()
        return self._view is not None and bool(self._registry)

    # ----- Service: requests -------------------------------------------------------------------

    async def infer(self, contract: ModelContract, inputs: Tensors, *, respond_async: bool = False,
                    when_full: WhenFull = "job", tenant: str | None = None,
                    idempotency_key: str | None = None) -> InferResult | JobAccepted:
        key = contract.key
        self._check_fits(key)
        if respond_async or idempotency_key is not None:
            if self._deployed(key):
                return await self._local.infer(contract, inputs, respond_async=respond_async, when_full=when_full,
                                               tenant=tenant, idempotency_key=idempotency_key)
            return await self._local.submit_job(contract, inputs, tenant, idempotency_key)
        return await self._follow(self._route(key), contract, inputs, when_full, tenant, avoid=())

    def _route(self, key: str) -> ServeHere | Forward | AskController:
        room = self._local.has_room(key)
        if self._snapshot is None:
            return ServeHere("local hot") if room or self._deployed(key) else AskController()
        return route(key, self._snapshot, self._rng, self._s.node_id, room)

    async def _follow(self, decision: ServeHere | Forward | AskController | Enqueue, contract: ModelContract,
                      inputs: Tensors, when_full: WhenFull, tenant: str | None,
                      avoid: tuple[str, ...]) -> InferResult | JobAccepted:
        own: Placed | None = None
        if isinstance(decision, AskController):
            placement, own = await self._place(contract.key, avoid)
            decision = self._after(placement, contract.key, avoid)
        if isinstance(decision, Enqueue):
            log.info("cluster: %s becomes a job: %s", contract.key, decision.reason)
            return await self._local.submit_job(contract, inputs, tenant)
        try:
            with self._told_if_slow(own):
                if isinstance(decision, ServeHere):
                    return await self.serve_local(contract, inputs, when_full, tenant)
                self.forwarded += 1
                return await self._forwarder.infer(self._url(decision.node), contract, inputs,
                                                   forwarded_headers())
        except NodeUnreachable as err:
            if avoid or not isinstance(decision, Forward):   # retried once, and only what was forwarded
                raise
            self._again(err, decision.node, contract)
            return await self._follow(self._route(contract.key), contract, inputs, when_full, tenant,
                                      avoid=(decision.node,))

    def _again(self, err: NodeUnreachable, node: str, contract: ModelContract) -> None:
        """A forward to `node` failed: the node leaves this gateway's view, and the request may go elsewhere only
        if it never reached the node, or running it twice does no harm (else NodeUnreachable, naming why)."""
        self._drop(node, cut=not err.answered)
        if not isinstance(err, NotDelivered) and not contract.idempotent:
            self.lost += 1
            raise NodeUnreachable(f"{err.message}; not run again on another node: the request reached that node, "
                                  f"which may have run it, and model '{contract.key}' is not idempotent (a contract "
                                  "may say `idempotent: true`)")
        log.warning("cluster: %s; sending %s once elsewhere (%s)", err.message, contract.key,
                    "never delivered" if isinstance(err, NotDelivered) else "idempotent")
        self.retried += 1

    async def _place(self, key: str, avoid: tuple[str, ...]) -> tuple[Placement, Placed | None]:
        """On this gateway's own view when it is fresh (the same rule the controller runs, microseconds instead of
        an actor call's milliseconds on the event loop), returned second too: the controller is still to be told
        of it (`_told_if_slow`); else, or when the view places nothing, the controller."""
        if (self._snapshot is not None and key in self._snapshot.models
                and asyncio.get_running_loop().time() - self._view_at <= self._s.fresh_s):
            mine = place(key, without(self._snapshot, avoid), here=self._s.node_id)
            if isinstance(mine, Placed):
                return mine, mine
        try:
            return await asyncio.wait_for(self._link.place(key, avoid, self._s.node_id), self._s.place_timeout_s), None
        except Exception as err:   # the controller away: the same rule on this node's last view
            log.warning("cluster: the controller did not place %s (%s: %s); placing on the last view", key,
                        type(err).__name__, err)
        if self._snapshot is None or key not in self._snapshot.models:
            return Unplaceable(key, f"model '{key}': no cluster view to place it on"), None
        return place(key, without(self._snapshot, avoid), here=self._s.node_id), None

    def _after(self, placement: Placement, key: str, avoid: tuple[str, ...]) -> ServeHere | Forward | Enqueue:
        """The placement as the next step: nowhere to start one, a node with the model deployed still takes it."""
        view = None if self._snapshot is None else without(self._snapshot, avoid)
        return after_placement(placement, self._s.node_id, self._deployed(key), view)

    @contextlib.contextmanager
    def _told_if_slow(self, placement: Placed | None) -> Iterator[None]:
        """Tell the controller of a start placed on this gateway's own view (it counts the start as queued on its
        node until that node reports again), unless the start was answered within `tell_after_s`: a Ray call
        takes 0.5-2 ms of CPU here and in the controller, which on a small machine a template fork on another
        node waits for; a start answered already shows in its node's next report."""
        told = None if placement is None else asyncio.get_running_loop().call_later(
            self._s.tell_after_s, self._tell, placement)
        try:
            yield
        finally:
            if told is not None:
                told.cancel()

    def _tell(self, placement: Placed) -> None:
        try:
            self._link.placed(placement)
        except Exception as err:   # Ray's errors: the controller learns of the start at the next report
            log.warning("cluster: could not tell the controller of a start of %s (%s)", placement.model, err)

    async def serve_local(self, contract: ModelContract, inputs: Tensors, when_full: WhenFull = "job",
                          tenant: str | None = None) -> InferResult | JobAccepted:
        """Serve on this node's ladder, deploying the model here first when the cluster placed it here."""
        if not self._deployed(contract.key):
            await self._deploy_here(contract)
        return await self._local.infer(contract, inputs, when_full=when_full, tenant=tenant)

    async def serve_forwarded(self, contract: ModelContract, inputs: Tensors,
                              tenant: str | None) -> InferResult | JobAccepted:
        """A request another node forwarded here (`POST /cluster/infer/...`), admitted as its caller's."""
        return await self.serve_local(contract, inputs, tenant=tenant)

    def _check_fits(self, key: str) -> None:
        """ModelTooLarge for a model no node of the cluster could hold (the controller's `refused`)."""
        if self._view is not None and key in self._view.refused:
            raise ModelTooLarge(self._view.refused[key])

    def _deployed(self, key: str) -> bool:
        return key in self._local.snapshot().models

    async def _deploy_here(self, contract: ModelContract) -> None:
        """One deploy per model at a time, however many requests the placement sent here at once."""
        task = self._deploying.get(contract.key)
        if task is None:
            task = self._deploy_task(contract)
            log.info("cluster: placed here: deploying %s", contract.key)
        await asyncio.shield(task)

    def _deploy_task(self, contract: ModelContract) -> asyncio.Task[None]:
        task = asyncio.ensure_future(self._local.deploy(contract))
        self._deploying[contract.key] = task
        task.add_done_callback(lambda t: self._deployed_or_failed(contract.key, t))
        return task

    def _deployed_or_failed(self, key: str, task: asyncio.Task[None]) -> None:
        self._deploying.pop(key, None)
        if not task.cancelled() and (err := task.exception()) is not None:   # retrieved: no "never retrieved"
            log.warning("cluster: deploying %s here failed (%s)", key, err)

    async def stream(self, contract: ModelContract, inputs: Tensors, *, when_full: WhenFull = "reject",
                     tenant: str | None = None, on_claim: OnClaim | None = None) -> InferStream:
        """Routed as `infer` is: a local hot instance, a warm one on some node, else a start placed; a stream
        never becomes a job (nowhere to start one: Overloaded). A node unreachable before the stream's first reply
        is retried once elsewhere; after it, a failure ends the stream with an error (the replies raise it).
        `on_claim`: told of a local claim (a forwarded stream's rung comes with its first reply)."""
        self._check_fits(contract.key)
        return await self._follow_stream(self._route(contract.key), contract, inputs, when_full, tenant, avoid=(),
                                         on_claim=on_claim)

    async def _follow_stream(self, decision: ServeHere | Forward | AskController | Enqueue, contract: ModelContract,
                             inputs: Tensors, when_full: WhenFull, tenant: str | None,
                             avoid: tuple[str, ...], on_claim: OnClaim | None = None) -> InferStream:
        own: Placed | None = None
        if isinstance(decision, AskController):
            placement, own = await self._place(contract.key, avoid)
            decision = self._after(placement, contract.key, avoid)
        if isinstance(decision, Enqueue):
            raise Overloaded(f"model '{contract.key}': no node has room for a stream ({decision.reason})",
                             retry_after=self._s.stream_retry_s)
        try:
            with self._told_if_slow(own):   # a stream's start is answered with its first reply
                if isinstance(decision, ServeHere):
                    return await self.serve_stream_local(contract, inputs, when_full, tenant, on_claim)
                self.forwarded += 1
                return await self._forwarder.stream(self._url(decision.node), contract, inputs,
                                                    forwarded_headers())
        except NodeUnreachable as err:
            if avoid or not isinstance(decision, Forward):   # retried once, and only what was forwarded
                raise
            self._again(err, decision.node, contract)
            return await self._follow_stream(self._route(contract.key), contract, inputs, when_full, tenant,
                                             avoid=(decision.node,), on_claim=on_claim)

    async def serve_stream_local(self, contract: ModelContract, inputs: Tensors, when_full: WhenFull = "reject",
                                 tenant: str | None = None, on_claim: OnClaim | None = None) -> InferStream:
        """A stream on this node's ladder, deploying the model here first when the cluster placed it here."""
        if not self._deployed(contract.key):
            await self._deploy_here(contract)
        return await self._local.stream(contract, inputs, when_full=when_full, tenant=tenant, on_claim=on_claim)

    async def serve_stream(self, contract: ModelContract, inputs: Tensors, tenant: str | None) -> InferStream:
        """A stream another node forwarded here (`POST /cluster/stream/...`), admitted as its caller's."""
        return await self.serve_stream_local(contract, inputs, tenant=tenant)

    # ----- Service: the rest is the local node's ---------------------------------------------------

    def job(self, job_id: str) -> JobStatus:
        return self._local.job(job_id)

    def repository_index(self) -> list[RepositoryEntry]:
        return self._local.repository_index()

    async def load_model(self, name: str) -> None:
        for contract in self.contracts():
            if contract.name == name:
                self._check_fits(contract.key)
        await self._local.load_model(name)

    async def unload_model(self, name: str) -> None:
        await self._local.unload_model(name)

    def status(self) -> list[ModelStatus]:
        return self._local.status()

    async def node_status(self) -> dict[str, Any]:
        out = await self._local.node_status()
        nodes = self._view.nodes if self._view is not None else ()
        out["cluster"] = {"node": self._s.node_id, "url": self._s.url,
                          "view_version": self._view.version if self._view is not None else None,
                          "nodes": [{"node": n.node, "url": n.url, "warm": len(n.warm), "queue": n.queue}
                                    for n in nodes],
                          "forwarded": self.forwarded, "retried": self.retried, "lost": self.lost}
        return out

    async def close(self) -> None:
        for task in list(self._deploying.values()):
            task.cancel()
        with contextlib.suppress(EmberError, asyncio.CancelledError):
            await asyncio.gather(*self._deploying.values(), return_exceptions=True)
        await self._forwarder.close()

