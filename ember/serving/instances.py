"""Instances as the pool books them and the node runs them: start, resume, pause, sleep, wake, retire, crash.

Both the request path (a request starts or resumes an instance) and the tick (pre-starts, pauses,
recycles) act through here. Every decision is recorded in the pool before the first await, so no
request is ever routed to an instance on its way out, and two starts never book one slice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ember.core.clock import Clock
from ember.core.pool import Pool
from ember.core.slices import Slice
from ember.core.states import InstanceState, Rung
from ember.errors import ContractInvalid, EmberError, ModelNotReady, WorkerCrashed
from ember.node.api import Node, StartedInstance
from ember.serving.deployments import Deployment, Deployments, ModelState
from ember.serving.ports import NO_SPAN, LadderMetrics, Span

log = logging.getLogger("ember.controller")

Spawn = Callable[[Coroutine[Any, Any, None]], None]


@dataclass
class Claim:
    """A request's hold on one place in an instance."""

    instance_id: str
    rung: Rung
    time_to_ready_s: float | None
    released: bool = False
    phases: Mapping[str, float] = field(default_factory=dict)   # a start's: spawn, fetch, load, warmup seconds
    inference: Span = NO_SPAN   # from the send until the instance lets go of the request


class Instances:
    def __init__(self, pool: Pool, node: Node, deployments: Deployments, metrics: LadderMetrics, clock: Clock) -> None:
        self.pool, self.node, self._deployments = pool, node, deployments
        self._metrics, self._clock = metrics, clock
        self._room = asyncio.Event()   # replaced on every wake: waiters hold the one that was current
        self._on_room: list[Callable[[], None]] = []
        self._locks: dict[str, asyncio.Lock] = {}
        self._ids = 0
        node.on_exit(self._on_exit)

    def on_room(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever an instance may have room again (a request ended, a slice freed)."""
        self._on_room.append(callback)

    def room_changed(self) -> asyncio.Event:
        """Set at the next change that may give a waiting request room (a request ended, a slice freed)."""
        return self._room

    def wake(self) -> None:
        """Wake everyone waiting for room (synchronously: a request ending must not cost a task)."""
        self._room.set()
        self._room = asyncio.Event()
        for callback in self._on_room:
            callback()

    def release(self, instance_id: str, *, served: bool = True) -> None:
        if self.pool.get(instance_id) is not None:
            self.pool.release(instance_id, self._clock.now(), served=served)
        self.wake()

    # --- starting ---------------------------------------------------------------------------

    def reserve(self, key: str, rung: Rung, slice_id: str) -> tuple[str, Rung]:
        """Book the slice for a starting instance, synchronously with the decision to start it."""
        if rung is Rung.TEMPLATE and not self.node.has_template(key):
            # The template died since the last tick (the healer makes it again): start from the zygote.
            info = self.pool.models.get(key)
            if info is not None:
                self.pool.models[key] = replace(info, has_template=False)
            rung = Rung.ZYGOTE
        if rung in (Rung.ZYGOTE, Rung.FETCH, Rung.RESTORE):
            # The store may have evicted the weights (or another start fetched them), a keep-alive plan may have
            # released the zygote, an image may have been made, since the model's info was last set: a start
            # that needs a fetch must be counted as one.
            rung = self._refresh_start(key)
        self._ids += 1
        placeholder = f"{key}#{self._ids}"
        self.pool.add_starting(placeholder, key, slice_id, rung, self._clock.now())
        return placeholder, rung

    async def launch(self, placeholder: str, key: str, rung: Rung, slice_id: str, *, serve: bool) -> Claim:
        slice_ = next(s for s in self.pool.slices if s.id == slice_id)
        deployment = self._deployments.get(key)
        booked = self.pool.get(placeholder)
        if deployment is None or key not in self.pool.models or booked is None \
                or booked.state is not InstanceState.STARTING:
            self.pool.stopped(placeholder, self._clock.now())
            raise ModelNotReady(f"model '{key}' was unloaded before its instance started")
        try:
            started = await self._start(deployment, rung, slice_)
        except BaseException as err:
            self.pool.stopped(placeholder, self._clock.now())
            self.wake()  # the slice is free again for whoever waits
            if isinstance(err, WorkerCrashed) and key not in self.pool.models:
                raise ModelNotReady(f"model '{key}' was unloaded while an instance started") from None
            if isinstance(err, ContractInvalid):
                raise ModelNotReady(self._unavailable(deployment, err.message)) from None
            if isinstance(err, EmberError) and key in self.pool.models:
                self._start_failed(deployment, rung, err, logged=serve)
            raise
        entry = self.pool.get(placeholder)
        if entry is None or entry.state is not InstanceState.STARTING or key not in self.pool.models:
            # The model was unloaded while its instance started: nothing may route to it.
            self.pool.stopped(placeholder, self._clock.now())
            await self.node.stop(started.instance_id)
            raise ModelNotReady(f"model '{key}' was unloaded while an instance started")
        self._metrics.cold_start(key, started.rung, started.phases)
        self._start_succeeded(deployment)
        self.pool.rename(placeholder, started.instance_id, started.pid, started.sleep_levels)
        if started.rung is Rung.FETCH:
            self.pool.models[key] = replace(self.pool.models[key], weights_local=True)
        if serve:
            self.pool.acquire(started.instance_id, self._clock.now())
            if self.pool.models[key].per_instance > 1:
                self.wake()  # it has room for requests that waited on its start
        else:
            self.pool.transition(started.instance_id, InstanceState.IDLE, self._clock.now())
            self.wake()
        return Claim(started.instance_id, started.rung, started.time_to_ready_s, phases=started.phases)

    async def _start(self, deployment: Deployment, rung: Rung, slice_: Slice) -> StartedInstance:
        """Start on the node. A template its keep-alive plan released is made again on the way (with the zygote,
        if that went too), and the instance forks from it: it shares the weights as one kept all along would,
        and the start is counted on the rung it began from (`rung`, ZYGOTE or FETCH)."""
        contract = deployment.contract
        if rung is Rung.RESTORE:   # from the image: nothing of the model held in memory is made again for it
            try:
                return await self.node.start(contract, rung, slice_)
            except EmberError as err:   # the image is the node's cache: any failure leaves the rungs below
                log.warning("%s: no instance from its image (%s); starting it further down the ladder",
                            deployment.key, err.message)
                rung = Rung.FETCH
        if rung is Rung.TEMPLATE or not (deployment.released and contract.scaling.keep_template):
            started = await self.node.start(contract, rung, slice_)
            if rung is not Rung.TEMPLATE:
                self.set_runtime_ready(contract.runtime, True)   # the node brought the zygote up for it
            return started
        t0 = self._clock.now()
        for attempt in range(2):
            await self.node.prepare(contract)
            made_s = self._clock.now() - t0
            try:
                started = await self.node.start(contract, Rung.TEMPLATE, slice_)
                break
            except ModelNotReady:
                if attempt == 1:   # a release that was in flight took the template: once more, then give up
                    raise
        self.remade(deployment.key)
        phases = {**started.phases, "template": made_s}
        return replace(started, rung=rung, time_to_ready_s=self._clock.now() - t0, phases=phases)

    @staticmethod
    def _start_failed(deployment: Deployment, rung: Rung, err: EmberError, *, logged: bool) -> None:
        """A start failed: the model counts as failing for readiness until one succeeds. Logged here for the
        request path (the tick logs its own pre-starts) when a run of failures begins or its reason changes."""
        deployment.failed_starts += 1
        if logged and (deployment.failed_starts == 1 or err.message != deployment.start_error):
            log.error("%s: a start from the %s failed (%d in a row; not ready until a start succeeds): %s",
                      deployment.key, rung.value, deployment.failed_starts, err.message)
        deployment.start_error = err.message

    @staticmethod
    def _start_succeeded(deployment: Deployment) -> None:
        if deployment.failed_starts:
            log.info("%s: an instance started after %d failed start(s); ready again", deployment.key,
                     deployment.failed_starts)
        deployment.failed_starts, deployment.start_error = 0, ""

    def remade(self, key: str) -> None:
        """The model's template (and its zygote) are up again."""
        deployment = self._deployments.get(key)
        if deployment is not None:
            deployment.released = False
        info = self.pool.models.get(key)
        if info is not None:
            self.pool.models[key] = replace(info, has_template=self.node.has_template(key))
        self.set_runtime_ready(info.runtime if info is not None else "", True)

    def set_runtime_ready(self, runtime: str, ready: bool) -> None:
        for key, info in list(self.pool.models.items()):
            if info.runtime == runtime and info.runtime_ready != ready:
                self.pool.models[key] = replace(info, runtime_ready=ready)

    def _unavailable(self, deployment: Deployment, reason: str) -> str:
        """The model does not match its contract (its warm-up said so): no more starts until it is loaded again."""
        deployment.state, deployment.reason = ModelState.UNAVAILABLE, reason
        self.pool.models.pop(deployment.key, None)
        self.wake()   # requests waiting for it learn that it is gone
        log.error("%s is unavailable: %s", deployment.key, reason)
        return f"model '{deployment.key}' is unavailable: {reason}"

    def _refresh_start(self, key: str) -> Rung:
        """The model's start rung as the node stands now (`ModelInfo.start_rung`, its template aside)."""
        self._refresh_weights(key)
        info, deployment = self.pool.models.get(key), self._deployments.get(key)
        if info is None:
            return Rung.FETCH
        image = deployment is not None and self.node.can_restore(deployment.contract)
        if info.image_ready != image:
            info = self.pool.models[key] = replace(info, image_ready=image)
        zygote_up = info.runtime_ready and self.node.has_zygote(info.runtime or "")
        return replace(info, has_template=False, runtime_ready=zygote_up).start_rung

    def _refresh_weights(self, key: str) -> Rung:
        deployment = self._deployments.get(key)
        local = deployment is not None and self.node.weights_local(deployment.contract)
        info = self.pool.models.get(key)
        if info is not None and info.weights_local != local:
            self.pool.models[key] = replace(info, weights_local=local)
        return Rung.ZYGOTE if local else Rung.FETCH

    async def resume(self, key: str, instance_id: str) -> Claim | None:
        """SIGCONT a paused instance for a request (None: it died meanwhile; the ladder goes on)."""
        return await self._bring_back(key, instance_id, Rung.PAUSED, self.node.resume, "resume")

    async def wake_up(self, key: str, instance_id: str) -> Claim | None:
        """Wake an asleep instance's engine for a request (None: it died, or its engine failed to wake and it is
        recycled; the ladder goes on)."""
        inst = self.pool.get(instance_id)
        if inst is None or inst.state is not InstanceState.ASLEEP:
            return None
        # Claimed before its sleep began, it never sleeps: counted as what it was then, stopped (the wake a no-op).
        rung = inst.asleep_rung if inst.slept else Rung.PAUSED
        return await self._bring_back(key, instance_id, rung, self.node.wake, "wake")

    async def _bring_back(self, key: str, instance_id: str, rung: Rung,
                          act: Callable[[str], Coroutine[Any, Any, None]], event: str) -> Claim | None:
        t0 = self._clock.now()
        self.pool.acquire(instance_id, t0)
        # Shielded, what a failure means included: a request that leaves meanwhile must not cut a wake short (the
        # engine would be left half awake), nor skip recycling one that failed; the claim is handed back after.
        task = asyncio.ensure_future(self._act(key, instance_id, act, event))
        try:
            back = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: self._after_leaving(t, instance_id))
            raise
        except BaseException:
            self._hand_back(instance_id)
            raise
        if not back:
            return None
        self._metrics.instance_event(key, event)
        info = self.pool.models.get(key)
        if info is not None and info.per_instance > 1:
            self.wake()  # back with room for requests that waited meanwhile
        return Claim(instance_id, rung, self._clock.now() - t0)

    async def _act(self, key: str, instance_id: str, act: Callable[[str], Coroutine[Any, Any, None]],
                   event: str) -> bool:
        """`act` on the instance under its lock; False when it is gone: crashed, or failed and recycled."""
        try:
            async with self.lock(instance_id):
                await act(instance_id)
            return True
        except WorkerCrashed:
            self.mark_crashed(instance_id)
        except EmberError as err:
            log.warning("instance %s of %s did not %s (%s): recycling it", instance_id, key, event, err)
            await self.retire(instance_id)
        self.wake()   # its slice is free again for whoever waits
        return False

    def _after_leaving(self, task: asyncio.Future[bool], instance_id: str) -> None:
        """A wake whose request left: its outcome read (the instance is recycled or marked crashed in it), the
        claim handed back."""
        if not task.cancelled():
            task.exception()
        self._hand_back(instance_id)

    def _hand_back(self, instance_id: str) -> None:
        """A request's claim on an instance it never used (it left, or the node failed): released unserved."""
        inst = self.pool.get(instance_id)
        if inst is not None and inst.state is not InstanceState.STOPPED:
            self.release(instance_id, served=False)

    # --- idling and stopping ----------------------------------------------------------------

    async def sleep(self, instance_id: str, level: int) -> None:
        """Put an idle instance's engine to sleep (the tick marked it ASLEEP); one that cannot is recycled."""
        failed = False
        async with self.lock(instance_id):
            inst = self.pool.get(instance_id)
            if inst is None or inst.state is not InstanceState.ASLEEP:
                return   # a request woke it, or it was recycled, between the decision and this task
            self.pool.sleep_begins(instance_id)
            try:
                held_mb = await self.node.sleep(instance_id, level)
            except WorkerCrashed:
                self.mark_crashed(instance_id)
                self.wake()
                return
            except EmberError as err:
                log.warning("instance %s of %s could not sleep (%s): recycling it", instance_id, inst.model, err)
                # Unless a request claimed it meanwhile (it wakes it, and serves from it).
                current = self.pool.get(instance_id)
                failed = current is not None and current.state is InstanceState.ASLEEP
                if failed:
                    self.pool.transition(instance_id, InstanceState.DRAINING, self._clock.now())
            else:
                self.pool.slept(instance_id, held_mb)
                self._metrics.instance_event(inst.model, "sleep")
        if failed:
            await self.retire(instance_id)
        self.wake()   # its slice may host another instance now

    async def pause(self, instance_id: str) -> None:
        async with self.lock(instance_id):
            inst = self.pool.get(instance_id)
            # A request may have resumed it between the decision and this task running.
            if inst is not None and inst.state is InstanceState.PAUSED:
                self._metrics.instance_event(inst.model, "pause")
                try:
                    await self.node.pause(instance_id)
                except WorkerCrashed:
                    self.mark_crashed(instance_id)

    async def retire(self, instance_id: str, reason: str = "recycle") -> None:
        """Stop an instance (`reason`: recycle, evict, hung); callers mark it DRAINING first, synchronously with
        their decision, so no request can be routed to it in between."""
        inst = self.pool.get(instance_id)
        if inst is None or inst.state is InstanceState.STOPPED:
            return
        self._metrics.instance_event(inst.model, reason)
        if inst.state is not InstanceState.DRAINING:
            self.pool.transition(instance_id, InstanceState.DRAINING, self._clock.now())
        try:
            async with self.lock(instance_id):
                await self.node.stop(instance_id)
        finally:
            self.pool.stopped(instance_id, self._clock.now())
            self._locks.pop(instance_id, None)
            self.wake()

    def mark_crashed(self, instance_id: str) -> None:
        inst = self.pool.get(instance_id)
        if inst is None or inst.state is InstanceState.STOPPED:
            return
        if inst.state is not InstanceState.DRAINING:  # a draining instance was stopped on purpose
            self._metrics.worker_crash(inst.model)
        self.pool.stopped(instance_id, self._clock.now())

    def _on_exit(self, instance_id: str, status: int) -> None:
        inst = self.pool.get(instance_id)
        if inst is not None and inst.state not in (InstanceState.STOPPED, InstanceState.DRAINING):
            log.warning("instance %s of %s exited (status %d)", instance_id, inst.model, status)
            self.mark_crashed(instance_id)
            self.wake()

    def lock(self, instance_id: str) -> asyncio.Lock:
        return self._locks.setdefault(instance_id, asyncio.Lock())
