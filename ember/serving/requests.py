"""The request path: claim room in an instance down the ladder, send the request, hand back its replies.

A request holds its claim until the instance has let go of it (answered, stopped it on a cancel, or
died), not until its client has. On the usual path the last reply releases it at once. A client that
disconnects, or a request past its deadline, withdraws the request from the instance, whose room frees
as soon as the instance says it stopped. An instance that does not let go within one more timeout is
hung: it is stopped, so it cannot hold its slice forever.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from ember.core.clock import Clock
from ember.core.node_queue import Queue, place_queued
from ember.core.pool import Snapshot
from ember.core.scheduler import Evict, NoCapacity, Placement, Resume, Route, Start, Wait, Wake
from ember.core.states import InstanceState, Rung
from ember.errors import DeadlineExceeded, ModelNotReady, WorkerCrashed
from ember.node.api import Replies
from ember.serving.capacity import CapacityLog
from ember.serving.deployments import Deployment, Deployments, ModelState
from ember.serving.instances import Claim, Instances, Spawn
from ember.serving.ports import Histories, LadderMetrics, NoTracer, Tracer
from ember.serving.ports import NoCapacity as NoCapacityNow
from ember.serving.results import InferStream, OnClaim
from ember.wire.tensors import Tensors

log = logging.getLogger("ember.controller")


@dataclass(frozen=True)
class RequestSettings:
    request_timeout_s: float = 60.0
    queue_wait_s: float = 2.0      # how long a request waits for room before it becomes a job


@dataclass(frozen=True)
class Deadline:
    """When a request must have its last reply: its arrival plus its model's `limits.request_timeout_s`, else the
    server's `request_timeout_s`."""

    at: float
    timeout_s: float

    def left(self, now: float) -> float:
        return max(0.0, self.at - now)


class RequestPath:
    def __init__(self, instances: Instances, deployments: Deployments, metrics: LadderMetrics, clock: Clock,
                 spawn: Spawn, settings: RequestSettings, histories: Histories | None = None,
                 tracer: Tracer | None = None) -> None:
        self._instances, self._pool, self._node = instances, instances.pool, instances.node
        self._deployments, self._metrics, self._clock = deployments, metrics, clock
        self._spawn, self._settings, self._histories = spawn, settings, histories
        self._capacity = CapacityLog()
        self._tracer = tracer or NoTracer()
        self._queued: dict[str, list[object]] = {}   # per model, its requests waiting at the node (Queue), in order
        self._unbegun: dict[str, int] = {}   # per instance, requests sent whose first reply has not come

    async def open(self, key: str, inputs: Tensors, *, wait_s: float | None = None,
                   tenant: str | None = None, on_claim: OnClaim | None = None) -> InferStream:
        """Serve `inputs` on `key` for `tenant`'s caller (None: none): returns once the first reply is in;
        `on_claim` is told the rung as soon as the ladder decides it (the instance None while it starts: a fetch or
        an engine's load may take minutes), and again once an instance holds the request, both before the first
        reply. NoCapacity (of serving/ports) when no instance has room within `wait_s` (default: queue_wait_s)."""
        arrival = self._clock.now()
        deployment = self._deployment(key)
        timeout_s = deployment.contract.limits.timeout_s(self._settings.request_timeout_s)
        deadline = Deadline(arrival + timeout_s, timeout_s)
        self._observe_arrival(deployment, arrival)
        wait = self._settings.queue_wait_s if wait_s is None else wait_s
        wait_until = min(arrival + wait, deadline.at)
        for attempt in range(2):
            claim = await self._claim(key, wait_until, deadline.at, on_claim or _untold)
            if on_claim is not None:
                on_claim(claim.rung, claim.instance_id)
            try:
                replies, iterator, first = await self._first(claim, inputs, deadline, tenant)
            except WorkerCrashed:
                if attempt == 1:
                    raise
                log.warning("%s: instance %s crashed mid-request; retrying once", key, claim.instance_id)
                continue
            elapsed = self._clock.now() - arrival
            self._metrics.observe_ladder(key, claim.rung, claim.time_to_ready_s, elapsed)
            if claim.rung in (Rung.TEMPLATE, Rung.ZYGOTE, Rung.RESTORE, Rung.FETCH) \
                    and claim.time_to_ready_s is not None:
                self._metrics.first_response(key, claim.rung, max(0.0, elapsed - claim.time_to_ready_s))
            return InferStream(claim.rung, claim.instance_id, self._rest(claim, first, replies, iterator, deadline),
                               functools.partial(self._abandon, claim, replies, deadline))
        raise AssertionError("unreachable")

    def _deployment(self, key: str) -> Deployment:
        deployment = self._deployments.get(key)
        if deployment is not None and deployment.state is ModelState.UNAVAILABLE:
            raise ModelNotReady(f"model '{key}' is unavailable: {deployment.reason}")
        if deployment is None or key not in self._pool.models:
            raise ModelNotReady(f"model '{key}' is not loaded")
        return deployment

    async def _first(self, claim: Claim, inputs: Tensors, deadline: Deadline,
                     tenant: str | None) -> tuple[Replies, AsyncIterator[Tensors], Tensors | None]:
        """`_send`, the request counted among those its instance has not begun until its first reply (or failure)."""
        iid = claim.instance_id
        self._unbegun[iid] = self._unbegun.get(iid, 0) + 1
        try:
            return await self._send(claim, inputs, deadline, tenant)
        finally:
            left = self._unbegun.pop(iid, 1) - 1
            if left > 0:
                self._unbegun[iid] = left
            inst = self._pool.get(iid)
            if inst is not None and self._queued.get(inst.model):
                self._instances.wake()   # it may begin another: the model's queue walks the ladder again

    async def _send(self, claim: Claim, inputs: Tensors, deadline: Deadline,
                    tenant: str | None) -> tuple[Replies, AsyncIterator[Tensors], Tensors | None]:
        """Send the request on its claim; the claim is released when the instance lets go of it."""
        remaining = deadline.at - self._clock.now()
        if remaining <= 0:
            # The start took the whole budget: the instance stays, warm, for the next request.
            self._instances.release(claim.instance_id, served=False)
            raise DeadlineExceeded(f"no instance ready within {deadline.timeout_s:g}s")
        claim.inference = self._tracer.start("inference")   # ends as the claim is released
        try:
            replies = await self._node.open(claim.instance_id, inputs, timeout_s=remaining, tenant=tenant)
        except BaseException as err:
            if isinstance(err, WorkerCrashed):
                self._instances.mark_crashed(claim.instance_id)
            self._drop(claim, err)
            raise
        iterator = aiter(replies)
        try:
            return replies, iterator, await self._next(claim, replies, iterator, deadline)
        except StopAsyncIteration:
            return replies, iterator, None
        except BaseException as err:
            claim.inference.fail(_failure(err))
            self._abandon(claim, replies, deadline)
            raise

    def _drop(self, claim: Claim, err: BaseException) -> None:
        """The request never reached the instance: its room is free again, and nothing was served."""
        claim.inference.fail(_failure(err))
        claim.inference.end()
        self._instances.release(claim.instance_id, served=False)

    async def _next(self, claim: Claim, replies: Replies, iterator: AsyncIterator[Tensors],
                    deadline: Deadline) -> Tensors:
        """The next reply; past the deadline (or when this request is cancelled) the instance is told to stop."""
        try:
            if replies.done:
                return await anext(iterator)   # every frame is in: nothing left to wait for, or to time out
            async with asyncio.timeout(deadline.left(self._clock.now())):
                return await anext(iterator)
        except TimeoutError:
            replies.cancel()
            raise DeadlineExceeded(f"no answer within {deadline.timeout_s:g}s") from None
        except WorkerCrashed:
            self._instances.mark_crashed(claim.instance_id)
            raise
        except StopAsyncIteration:
            raise
        except BaseException:
            replies.cancel()
            raise

    async def _rest(self, claim: Claim, first: Tensors | None, replies: Replies, iterator: AsyncIterator[Tensors],
                    deadline: Deadline) -> AsyncGenerator[Tensors, None]:
        try:
            if first is None:
                return
            yield first
            while True:
                try:
                    reply = await self._next(claim, replies, iterator, deadline)
                except StopAsyncIteration:
                    return
                yield reply
        finally:
            if replies.done:
                self._release(claim)   # now, not a loop turn later: the client's next request finds the room
            else:
                self._abandon(claim, replies, deadline)   # the client left mid-stream, or a reply timed out

    def _abandon(self, claim: Claim, replies: Replies, deadline: Deadline) -> None:
        """Nobody reads the replies any more: stop the request, and release its claim once the instance has."""
        if claim.released:
            return
        if replies.done:
            self._release(claim)
            return
        claim.inference.set("ember.withdrawn", True)
        replies.cancel()
        self._spawn(self._settle(claim, replies, deadline))

    async def _settle(self, claim: Claim, replies: Replies, deadline: Deadline) -> None:
        """Release the claim once the instance has let go of the request; stop the instance if it never does."""
        grace = deadline.left(self._clock.now()) + deadline.timeout_s
        try:
            async with asyncio.timeout(grace):
                await replies.settled()
        except TimeoutError:
            inst = self._pool.get(claim.instance_id)
            if inst is not None and inst.state not in (InstanceState.STOPPED, InstanceState.DRAINING):
                log.warning("instance %s of %s is hung past twice the request timeout; stopping it",
                            claim.instance_id, inst.model)
                self._pool.transition(claim.instance_id, InstanceState.DRAINING, self._clock.now())
                await self._instances.retire(claim.instance_id, "hung")
        finally:
            self._release(claim)

    def _release(self, claim: Claim) -> None:
        if claim.released:
            return
        claim.released = True
        claim.inference.end()
        inst = self._pool.get(claim.instance_id)
        deployment = self._deployments.get(inst.model) if inst is not None else None
        if deployment is not None:
            now = self._clock.now()
            deployment.last_done = now
            deployment.served.completed(now)
        self._instances.release(claim.instance_id)

    # --- claiming ---------------------------------------------------------------------------

    async def _claim(self, key: str, wait_until: float, queue_until: float, decided: OnClaim) -> Claim:
        """Walk the ladder until this request holds room in an instance (acquired in the pool); `decided` is told
        each rung it takes, before its instance comes up. A request of a model that queues at the node
        (`ember.core.node_queue`) waits there for an instance that can begin it, in its place in the model's queue,
        until `queue_until` (its deadline)."""
        queued = self._queued.setdefault(key, [])
        ticket = object()
        try:
            while True:
                if key not in self._pool.models:
                    raise ModelNotReady(f"model '{key}' was unloaded")   # while this request waited for room
                snapshot = self._pool.snapshot()
                ahead = queued.index(ticket) if ticket in queued else len(queued)
                decision = place_queued(key, snapshot, ahead, self._unbegun)
                self._note_capacity(key, decision)
                if isinstance(decision, Queue):
                    if ticket not in queued:
                        queued.append(ticket)
                    await self._queue(key, snapshot, queue_until)
                    continue
                if ticket in queued:
                    queued.remove(ticket)   # out of the queue before the rung's first await
                claim = await self._take(key, decision, snapshot, wait_until, decided)
                if claim is not None:
                    return claim
        finally:
            if ticket in queued:
                queued.remove(ticket)

    async def _queue(self, key: str, snapshot: Snapshot, queue_until: float) -> None:
        """Wait at the node for an instance that can begin the request; DeadlineExceeded if none could before
        `queue_until`."""
        self._activate(key, snapshot, self._clock.now())
        try:
            with self._tracer.start("queue_wait"):
                await self._wait_for_room(key, queue_until)
        except NoCapacityNow:
            raise DeadlineExceeded(f"{key}: no instance began the request before its deadline") from None

    async def _take(self, key: str, decision: Placement, snapshot: Snapshot, wait_until: float,
                    decided: OnClaim) -> Claim | None:
        """Take the rung the ladder decided: the claim, or None to walk it again (an instance that died while it
        resumed or woke, an eviction, a wait for room)."""
        now = self._clock.now()
        if isinstance(decision, Route):
            self._pool.acquire(decision.instance_id, now)
            return Claim(decision.instance_id, Rung.HOT, 0.0)
        self._activate(key, snapshot, now)
        if isinstance(decision, Resume):
            decided(Rung.PAUSED, decision.instance_id)
            return await self._resume(key, decision.instance_id)
        if isinstance(decision, Wake):
            decided(decision.rung, decision.instance_id)
            return await self._wake(key, decision)
        if isinstance(decision, Start):
            return await self._start(key, decision, decided)
        if isinstance(decision, Evict):
            self._pool.transition(decision.victim_id, InstanceState.DRAINING, now)
            with self._tracer.start("evict") as span:
                span.set("ember.instance", decision.victim_id)
                await self._instances.retire(decision.victim_id, "evict")
        elif isinstance(decision, Wait):
            with self._tracer.start("queue_wait"):
                await self._wait_for_room(key, wait_until)
        elif isinstance(decision, NoCapacity):
            raise NoCapacityNow(decision.reason)
        return None

    def _note_capacity(self, key: str, decision: Placement | Queue) -> None:
        """Log when the model starts or stops getting no slice (Wait, Queue: its own instances are busy, no
        change)."""
        if isinstance(decision, NoCapacity):
            self._capacity.short(key, decision.reason)
        elif not isinstance(decision, Wait | Queue):
            self._capacity.room(key)

    async def _resume(self, key: str, instance_id: str) -> Claim | None:
        with self._tracer.start("resume") as span:
            span.set("ember.rung", Rung.PAUSED.value)
            span.set("ember.instance", instance_id)
            claim = await self._instances.resume(key, instance_id)
            if claim is None:
                span.fail("the instance died while it resumed")   # the ladder goes on
            return claim

    async def _wake(self, key: str, decision: Wake) -> Claim | None:
        with self._tracer.start("wake") as span:
            span.set("ember.rung", decision.rung.value)
            span.set("ember.instance", decision.instance_id)
            claim = await self._instances.wake_up(key, decision.instance_id)
            if claim is None:
                span.fail("the instance died while it woke")   # the ladder goes on
            return claim

    async def _start(self, key: str, decision: Start, decided: OnClaim) -> Claim:
        placeholder, rung = self._instances.reserve(key, decision.rung, decision.slice_id)
        decided(rung, None)   # no instance yet: its id comes with the start
        with self._tracer.start("fork") as span:
            span.set("ember.rung", rung.value)
            claim = await self._instances.launch(placeholder, key, rung, decision.slice_id, serve=True)
            span.set("ember.rung", claim.rung.value)
            span.set("ember.instance", claim.instance_id)
            span.phases(claim.phases)
            return claim

    async def _wait_for_room(self, key: str, wait_until: float) -> None:
        budget = wait_until - self._clock.now()
        if budget <= 0:
            raise NoCapacityNow(f"{key}: no instance had room in time")
        deployment = self._deployment(key)
        deployment.waiting += 1
        try:
            async with asyncio.timeout(budget):
                await self._instances.room_changed().wait()
        except TimeoutError:
            raise NoCapacityNow(f"{key}: no instance had room within {budget:.1f}s") from None
        finally:
            deployment.waiting -= 1

    def _observe_arrival(self, deployment: Deployment, now: float) -> None:
        """Record the idle period this arrival ends, in a history of the keep-alive policy's or the warm pool's
        forecast's (`histories`; none: nothing reads one): 0 s if the model is busy (a request in an instance,
        starting one, or waiting for room), as the simulator counts an arrival during an execution."""
        mine = self._pool.snapshot().of_model(deployment.key)
        busy = deployment.waiting > 0 or any(i.inflight or i.state is InstanceState.STARTING for i in mine)
        # Made again from the history (and the node's pooled prior then) on the next tick, not here: at every
        # arrival, the first too, as the simulator plans each idle period from what was seen up to its start.
        deployment.plan = deployment.even_plan = None
        if (deployment.last_done is None and not busy) or self._histories is None:
            return   # its first arrival: no idle period before it (one while its first request runs is busy: 0 s)
        if deployment.history is None:
            deployment.history = self._histories.new_history()
        deployment.history.observe(0.0 if busy or deployment.last_done is None
                                   else max(0.0, now - deployment.last_done))

    def _activate(self, key: str, snapshot: Snapshot, now: float) -> None:
        """KPA's activator: a request at zero scale is an immediate scale-up signal."""
        deployment = self._deployments.get(key)
        starting = (InstanceState.STARTING, InstanceState.DRAINING)
        ready = sum(1 for i in snapshot.of_model(key) if i.state not in starting)
        if ready == 0 and deployment is not None and deployment.autoscaler is not None:
            deployment.autoscaler.activate(now, 0)


def _untold(rung: Rung, instance_id: str | None) -> None:
    """Nobody asked to be told of the claim."""


def _failure(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
