"""The controller: the `Service` behind the gateway.

It owns the pool's bookkeeping and turns the core's decisions into node calls:
`scheduler.place` for each request, `lifecycle.decide` (with the autoscaler's wish) on
every tick, and the durable job queue when there is no capacity. Decisions are taken
and recorded in the pool synchronously, before any await, so two requests can never
claim the same instance or slice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from typing import Any

from ember.core.autoscaler import Autoscaler, AutoscalerConfig
from ember.core.clock import Clock
from ember.core.forecast import IdleHistory
from ember.core.keepalive import IdlePlan, KeepAlivePolicy
from ember.core.lifecycle import Pause, Prestart, Recycle
from ember.core.lifecycle import decide as decide_lifecycle
from ember.core.pool import ModelInfo, Pool
from ember.core.scheduler import Evict, NoCapacity, Resume, Route, Start, Wait, place
from ember.core.slices import Slice
from ember.core.states import InstanceState, Rung
from ember.errors import DeadlineExceeded, EmberError, ModelNotFound, ModelNotReady, WorkerCrashed
from ember.node.api import Node
from ember.serving.jobs import JobRunner
from ember.serving.ports import JobQueue, LadderMetrics
from ember.serving.ports import NoCapacity as NoCapacityNow
from ember.serving.repository import Repository
from ember.serving.results import InferResult, JobAccepted, JobStatus, ModelStatus, RepositoryEntry
from ember.serving.status import model_status
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

log = logging.getLogger("ember.controller")


@dataclass(frozen=True)
class ControllerSettings:
    request_timeout_s: float = 60.0
    queue_wait_s: float = 2.0        # how long a request waits for a busy instance before becoming a job
    tick_s: float = 0.25
    job_retry_after_s: float = 2.0
    # None: each model follows its contract's pause_after_s / max_idle_s. Otherwise the same
    # policy object the simulator evaluates decides each model's idle rung from its history.
    keepalive: KeepAlivePolicy | None = None


@dataclass
class _Claim:
    instance_id: str
    rung: Rung
    time_to_ready_s: float | None


class Controller:
    def __init__(self, node: Node, jobs: JobQueue, metrics: LadderMetrics, clock: Clock,
                 slices: list[Slice], repository: Repository, settings: ControllerSettings | None = None) -> None:
        self._node, self._jobs, self._metrics, self._clock = node, jobs, metrics, clock
        self._settings = settings or ControllerSettings()
        self._repo = repository
        self._pool = Pool(slices=tuple(slices))
        self._contracts: dict[str, ModelContract] = {}
        self._states: dict[str, tuple[str, str]] = {}   # key -> (state, reason)
        self._autoscalers: dict[str, Autoscaler] = {}
        self._waiting: dict[str, int] = {}
        self._histories: dict[str, IdleHistory] = {}
        self._plans: dict[str, IdlePlan] = {}
        self._last_done: dict[str, float] = {}
        self._prestart_backoff: dict[str, tuple[float, float]] = {}   # key -> (retry after, last delay)
        self._freed = asyncio.Condition()
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._ids = 0
        self._runner = JobRunner(jobs, metrics, self._serve, self._placeable_keys, self._spawn,
                                 self._settings.job_retry_after_s)
        node.on_exit(self._on_exit)

    # ----- deployment -------------------------------------------------------------

    async def deploy_all(self) -> None:
        """Deploy every valid contract; bad ones stay listed as UNAVAILABLE."""
        for entry in self._repo.scan():
            if entry.contract is None:
                log.error("skipping %s: %s", entry.path, entry.error)
                self._states[entry.name] = ("UNAVAILABLE", entry.error or "invalid contract")
                continue
            with contextlib.suppress(EmberError):
                await self.deploy(entry.contract)
        entries = self._repo.scan()
        await self._runner.recover(known=[(e.contract.name, e.contract.version) for e in entries if e.contract],
                                   invalid=[e.name for e in entries if e.contract is None])

    async def deploy(self, contract: ModelContract) -> None:
        key = contract.key
        self._contracts[key] = contract
        self._states.pop(contract.name, None)
        self._states[key] = ("LOADING", "")
        self._check_fits(contract)
        try:
            await self._node.prepare(contract)
        except EmberError as err:
            self._states[key] = ("UNAVAILABLE", err.message)
            log.error("cannot deploy %s: %s", key, err.message)
            raise
        s = contract.scaling
        self._pool.models[key] = ModelInfo(
            key=key, slice_kind=contract.resources.slice, memory_mb=contract.resources.memory_mb,
            min_scale=s.min_scale, max_scale=s.max_scale, target_concurrency=s.target_concurrency,
            pause_after_s=s.pause_after_s, max_idle_s=s.max_idle_s, has_template=self._node.has_template(key),
            weights_local=self._node.weights_local(contract))
        self._autoscalers[key] = Autoscaler(AutoscalerConfig.from_contract(contract), created_at=self._clock.now())
        self._states[key] = ("READY", "")
        log.info("deployed %s (template: %s)", key, self._node.has_template(key))

    def _check_fits(self, contract: ModelContract) -> None:
        res = contract.resources
        if not any(s.fits(res.slice, res.memory_mb) for s in self._pool.slices):
            reason = f"resources: no {res.slice} slice on this node holds {res.memory_mb} MB"
            self._states[contract.key] = ("UNAVAILABLE", reason)
            raise ModelNotReady(f"{contract.key}: {reason}")

    async def undeploy(self, key: str) -> None:
        self._pool.models.pop(key, None)
        self._autoscalers.pop(key, None)
        self._prestart_backoff.pop(key, None)
        now = self._clock.now()
        mine = self._pool.snapshot().of_model(key)
        # Its slices stay booked (DRAINING) until the processes are gone: another model started
        # there meanwhile could find the memory still taken.
        for inst in mine:
            if inst.state is not InstanceState.DRAINING:
                self._pool.transition(inst.id, InstanceState.DRAINING if inst.state is not InstanceState.STARTING
                                      else InstanceState.STOPPED, now)
        await self._notify()  # waiting requests learn the model is gone
        try:
            await self._node.release(key)
        finally:
            for inst in mine:
                self._pool.stopped(inst.id, self._clock.now())
            self._contracts.pop(key, None)
            self._states[key] = ("UNAVAILABLE", "unloaded")
            await self._notify()

    # ----- Service: models ------------------------------------------------------------

    def contracts(self) -> list[ModelContract]:
        return [c for k, c in self._contracts.items() if self._states.get(k, ("",))[0] == "READY"]

    def contract(self, name: str, version: str | None = None) -> ModelContract:
        found = [c for c in self._contracts.values() if c.name == name and version in (None, c.version)]
        if not found:
            what = f"model '{name}'" + (f" version '{version}'" if version else "")
            raise ModelNotFound(f"{what} is not deployed")
        return max(found, key=lambda c: _version_order(c.version))

    def model_ready(self, name: str, version: str | None = None) -> bool:
        try:
            return self._states.get(self.contract(name, version).key, ("",))[0] == "READY"
        except ModelNotFound:
            return False

    def server_ready(self) -> bool:
        """Nothing still loading, and at least one model able to serve (failed ones do not block)."""
        states = [self._states.get(k, ("",))[0] for k in self._contracts]
        return "READY" in states and "LOADING" not in states

    def repository_index(self) -> list[RepositoryEntry]:
        out = []
        for entry in self._repo.scan():
            if entry.contract is None:
                out.append(RepositoryEntry(entry.name, "", "UNAVAILABLE", entry.error or ""))
                continue
            state, reason = self._states.get(entry.contract.key, ("UNAVAILABLE", "not loaded"))
            out.append(RepositoryEntry(entry.contract.name, entry.contract.version, state, reason))  # type: ignore[arg-type]
        return out

    async def load_model(self, name: str) -> None:
        for contract in self._repo.find(name):
            if contract.key in self._pool.models:
                await self.undeploy(contract.key)
            await self.deploy(contract)

    async def unload_model(self, name: str) -> None:
        keys = [k for k, c in self._contracts.items() if c.name == name]
        if not keys:
            raise ModelNotFound(f"model '{name}' is not loaded")
        for key in keys:
            await self.undeploy(key)
        await self._runner.fail_model(name)

    def job(self, job_id: str) -> JobStatus:
        return self._jobs.get(job_id)

    # ----- Service: requests -------------------------------------------------------

    async def infer(self, contract: ModelContract, inputs: Tensors, *,
                    respond_async: bool = False) -> InferResult | JobAccepted:
        key = contract.key
        state, reason = self._states.get(key, ("UNAVAILABLE", "not deployed"))
        if state != "READY":
            raise ModelNotReady(f"model '{contract.name}' is not ready: {reason or state.lower()}")
        if respond_async:
            return await self._runner.submit(contract, inputs)
        try:
            return await self._serve(key, inputs)
        except NoCapacityNow:
            return await self._runner.submit(contract, inputs)

    async def _serve(self, key: str, inputs: Tensors) -> InferResult:
        arrival = self._clock.now()
        deadline = arrival + self._settings.request_timeout_s
        self._observe_arrival(key, arrival)
        scaler = self._autoscalers.get(key)
        if scaler is None:
            raise ModelNotReady(f"model '{key}' is not loaded")
        ready = self._ready_count(key)
        if ready == 0:
            # KPA's activator: a request at zero scale is an immediate scale-up signal.
            scaler.activate(arrival, ready)
        # A request waits for a busy instance at most queue_wait_s in all, then becomes a job.
        wait_until = min(arrival + self._settings.queue_wait_s, deadline)
        for attempt in range(2):
            claim = await self._claim(key, wait_until)
            if self._clock.now() >= deadline:
                # The start took the whole budget: the instance stays, warm, for the next request.
                await self._release(claim.instance_id, served=False)
                raise DeadlineExceeded(f"model '{key}': no instance ready within "
                                       f"{self._settings.request_timeout_s:g}s")
            task = asyncio.ensure_future(self._infer_and_release(key, claim.instance_id, inputs))
            # asyncio.wait leaves the task running if this request is cancelled or times out: the
            # instance stays claimed until it really answers (and is stopped if it never does).
            try:
                await asyncio.wait((task,), timeout=max(0.0, deadline - self._clock.now()))
            except asyncio.CancelledError:
                self._spawn(self._abandon(claim.instance_id, task))
                raise
            if not task.done():
                self._spawn(self._abandon(claim.instance_id, task))
                raise DeadlineExceeded(f"model '{key}': no answer within {self._settings.request_timeout_s:g}s")
            try:
                outputs = task.result()
            except WorkerCrashed:
                if attempt == 1:
                    raise
                log.warning("%s: instance %s crashed mid-request; retrying once", key, claim.instance_id)
                continue
            self._metrics.observe_ladder(claim.rung, claim.time_to_ready_s, self._clock.now() - arrival)
            return InferResult(outputs, claim.rung, claim.instance_id)
        raise AssertionError("unreachable")

    def _observe_arrival(self, key: str, now: float) -> None:
        """Feed the keep-alive policy the idle period this arrival ends (if the model was idle)."""
        policy = self._settings.keepalive
        if policy is None or key not in self._last_done:
            return
        if any(i.inflight for i in self._pool.snapshot().of_model(key)):
            return
        history = self._histories.setdefault(key, policy.new_history())
        history.observe(now - self._last_done[key])
        self._plans[key] = policy.plan(history)

    async def _infer_and_release(self, key: str, instance_id: str, inputs: Tensors) -> Tensors:
        try:
            outputs = await self._node.infer(instance_id, inputs)
        except WorkerCrashed:
            self._mark_crashed(instance_id)
            raise
        finally:
            self._last_done[key] = self._clock.now()
            if self._pool.get(instance_id) is not None:
                await self._release(instance_id)
        return outputs

    async def _release(self, instance_id: str, *, served: bool = True) -> None:
        self._pool.release(instance_id, self._clock.now(), served=served)
        async with self._freed:
            self._freed.notify_all()

    async def _claim(self, key: str, wait_until: float) -> _Claim:
        """Walk the ladder until this request holds an instance (acquired in the pool)."""
        while True:
            if key not in self._pool.models:
                # Unloaded while this request waited for capacity.
                raise ModelNotReady(f"model '{key}' was unloaded")
            decision = place(key, self._pool.snapshot())
            now = self._clock.now()
            if isinstance(decision, Route):
                self._pool.acquire(decision.instance_id, now)
                return _Claim(decision.instance_id, Rung.HOT, 0.0)
            if isinstance(decision, Resume):
                claim = await self._resume(key, decision.instance_id)
                if claim is not None:
                    return claim
            elif isinstance(decision, Start):
                return await self._start(key, decision.rung, decision.slice_id, serve=True)
            elif isinstance(decision, Evict):
                self._pool.transition(decision.victim_id, InstanceState.DRAINING, now)
                await self._retire(decision.victim_id)
            elif isinstance(decision, Wait):
                await self._wait_for_capacity(key, wait_until)
            elif isinstance(decision, NoCapacity):
                raise NoCapacityNow(decision.reason)

    async def _resume(self, key: str, instance_id: str) -> _Claim | None:
        t0 = self._clock.now()
        self._pool.acquire(instance_id, t0)
        try:
            async with self._lock(instance_id):
                await self._node.resume(instance_id)
        except WorkerCrashed:
            self._mark_crashed(instance_id)
            return None
        except BaseException:
            # Cancelled (client gone) or a node error: the instance must not stay claimed.
            if self._pool.get(instance_id) is not None:
                await self._release(instance_id, served=False)
            raise
        info = self._pool.models.get(key)
        if info is not None and info.per_instance > 1:
            self._spawn(self._notify())  # resumed with room for requests that waited meanwhile
        return _Claim(instance_id, Rung.PAUSED, self._clock.now() - t0)

    async def _start(self, key: str, rung: Rung, slice_id: str, *, serve: bool) -> _Claim:
        placeholder, rung = self._reserve(key, rung, slice_id)
        return await self._launch(placeholder, key, rung, slice_id, serve=serve)

    def _reserve(self, key: str, rung: Rung, slice_id: str) -> tuple[str, Rung]:
        """Book the slice for a starting instance, synchronously with the decision to start it."""
        if rung in (Rung.ZYGOTE, Rung.FETCH):
            # The store may have evicted the weights (or another start fetched them) since the
            # model's info was last set: a start that needs a fetch must be counted as one.
            rung = self._refresh_weights(key, self._contracts[key])
        self._ids += 1
        placeholder = f"{key}#{self._ids}"
        self._pool.add_starting(placeholder, key, slice_id, rung, self._clock.now())
        return placeholder, rung

    async def _launch(self, placeholder: str, key: str, rung: Rung, slice_id: str, *, serve: bool) -> _Claim:
        slice_ = next(s for s in self._pool.slices if s.id == slice_id)
        contract = self._contracts.get(key)
        booked = self._pool.get(placeholder)
        if contract is None or key not in self._pool.models or booked is None \
                or booked.state is not InstanceState.STARTING:
            self._pool.stopped(placeholder, self._clock.now())
            raise ModelNotReady(f"model '{key}' was unloaded before its instance started")
        self._metrics.cold_start(key, rung)
        try:
            started = await self._node.start(contract, rung, slice_)
        except BaseException as err:
            self._pool.stopped(placeholder, self._clock.now())
            self._spawn(self._notify())  # the slice is free again for whoever waits
            if isinstance(err, WorkerCrashed) and key not in self._pool.models:
                raise ModelNotReady(f"model '{key}' was unloaded while an instance started") from None
            raise
        entry = self._pool.get(placeholder)
        if entry is None or entry.state is not InstanceState.STARTING or key not in self._pool.models:
            # The model was unloaded while its instance started: nothing may route to it.
            self._pool.stopped(placeholder, self._clock.now())
            await self._node.stop(started.instance_id)
            raise ModelNotReady(f"model '{key}' was unloaded while an instance started")
        self._pool.rename(placeholder, started.instance_id, started.pid)
        if started.rung is Rung.FETCH:
            self._pool.models[key] = replace(self._pool.models[key], weights_local=True)
        if serve:
            self._pool.acquire(started.instance_id, self._clock.now())
            if self._pool.models[key].per_instance > 1:
                self._spawn(self._notify())  # it has room for requests that waited on its start
        else:
            self._pool.transition(started.instance_id, InstanceState.IDLE, self._clock.now())
            await self._notify()
        return _Claim(started.instance_id, started.rung, started.time_to_ready_s)

    def _refresh_weights(self, key: str, contract: ModelContract) -> Rung:
        local = self._node.weights_local(contract)
        info = self._pool.models.get(key)
        if info is not None and info.weights_local != local:
            self._pool.models[key] = replace(info, weights_local=local)
        return Rung.ZYGOTE if local else Rung.FETCH

    async def _wait_for_capacity(self, key: str, wait_until: float) -> None:
        budget = wait_until - self._clock.now()
        if budget <= 0:
            raise NoCapacityNow(f"{key}: no instance freed in time")
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            async with self._freed:
                await asyncio.wait_for(self._freed.wait(), budget)
        except TimeoutError:
            raise NoCapacityNow(f"{key}: no instance freed within {budget:.1f}s") from None
        finally:
            self._waiting[key] -= 1

    async def _abandon(self, instance_id: str, task: asyncio.Future[Tensors]) -> None:
        """A request ran past its deadline: give it one more timeout to finish, then kill
        the instance, which would otherwise stay BUSY (and hold its slice) forever."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(task), self._settings.request_timeout_s)
        if task.done():
            return
        inst = self._pool.get(instance_id)
        if inst is not None and inst.state not in (InstanceState.STOPPED, InstanceState.DRAINING):
            log.warning("instance %s of %s is hung past twice the request timeout; stopping it",
                        instance_id, inst.model)
            self._pool.transition(instance_id, InstanceState.DRAINING, self._clock.now())
            await self._retire(instance_id)
        task.cancel()

    async def _retire(self, instance_id: str) -> None:
        """Stop an instance; callers mark it DRAINING first, synchronously with their decision,
        so no request can be routed to it in between."""
        inst = self._pool.get(instance_id)
        if inst is None or inst.state is InstanceState.STOPPED:
            return
        if inst.state is not InstanceState.DRAINING:
            self._pool.transition(instance_id, InstanceState.DRAINING, self._clock.now())
        try:
            async with self._lock(instance_id):
                await self._node.stop(instance_id)
        finally:
            self._pool.stopped(instance_id, self._clock.now())
            self._locks.pop(instance_id, None)
            async with self._freed:
                self._freed.notify_all()

    def _mark_crashed(self, instance_id: str) -> None:
        inst = self._pool.get(instance_id)
        if inst is None or inst.state is InstanceState.STOPPED:
            return
        if inst.state is not InstanceState.DRAINING:  # a draining instance was stopped on purpose
            self._metrics.worker_crash(inst.model)
        self._pool.stopped(instance_id, self._clock.now())

    def _on_exit(self, instance_id: str, status: int) -> None:
        inst = self._pool.get(instance_id)
        if inst is not None and inst.state not in (InstanceState.STOPPED, InstanceState.DRAINING):
            log.warning("instance %s of %s exited (status %d)", instance_id, inst.model, status)
            self._mark_crashed(instance_id)
            self._spawn(self._notify())

    async def _notify(self) -> None:
        async with self._freed:
            self._freed.notify_all()

    def _lock(self, instance_id: str) -> asyncio.Lock:
        return self._locks.setdefault(instance_id, asyncio.Lock())

    def _ready_count(self, key: str) -> int:
        return sum(1 for i in self._pool.snapshot().of_model(key)
                   if i.state not in (InstanceState.STARTING, InstanceState.DRAINING))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ----- background: ticks and jobs ------------------------------------------------

    async def run(self) -> None:
        """Tick until cancelled: autoscaler samples, lifecycle actions, jobs, gauges."""
        expire_every = max(1, int(60 / self._settings.tick_s))
        n = 0
        while True:
            try:
                await self.tick()
                if n % expire_every == 0:
                    await self._runner.expire()
            except EmberError as err:
                log.error("tick: %s", err)
            except Exception:
                # A bug in one tick must not stop scaling, recycling and jobs for good.
                log.exception("tick failed")
            n += 1
            await asyncio.sleep(self._settings.tick_s)

    async def tick(self) -> None:
        now = self._clock.now()
        desired = self._autoscale(now)
        policy = self._settings.keepalive
        if policy is not None:
            for k in self._pool.models:
                if k not in self._plans:
                    self._plans[k] = policy.plan(self._histories.setdefault(k, policy.new_history()))
        plans = self._plans if policy is not None else None
        idle = {k: now - t for k, t in self._last_done.items()}
        actions = decide_lifecycle(self._pool.snapshot(), now, desired, plans, idle)
        for action in actions:
            if isinstance(action, Pause):
                self._pool.transition(action.instance_id, InstanceState.PAUSED, now)
                self._spawn(self._pause(action.instance_id))
            elif isinstance(action, Recycle):
                log.info("recycling %s: %s", action.instance_id, action.reason)
                self._pool.transition(action.instance_id, InstanceState.DRAINING, now)
                self._spawn(self._retire(action.instance_id))
            elif isinstance(action, Prestart):
                if now < self._prestart_backoff.get(action.model, (0.0, 0.0))[0]:
                    continue  # its last pre-start failed: do not retry on every tick
                placeholder, rung = self._reserve(action.model, action.rung, action.slice_id)
                self._spawn(self._prestart(placeholder, action.model, rung, action.slice_id))
        self._pool.forget_stopped()
        self._publish_gauges()
        if await self._runner.has_queued():
            await self._runner.run_pending()

    def _autoscale(self, now: float) -> dict[str, int]:
        desired = {}
        snapshot = self._pool.snapshot()
        for key, scaler in self._autoscalers.items():
            mine = snapshot.of_model(key)
            concurrency = sum(i.inflight for i in mine) + self._waiting.get(key, 0)
            scaler.record(now, float(concurrency))
            ready = sum(1 for i in mine if i.state is not InstanceState.STARTING)
            decision = scaler.decide(now, ready)
            # Pre-start for the autoscaler only under load: idle capacity is the lifecycle's call.
            desired[key] = decision.desired if concurrency > 0 else 0
        return desired

    async def _pause(self, instance_id: str) -> None:
        async with self._lock(instance_id):
            inst = self._pool.get(instance_id)
            # A request may have resumed it between the decision and this task running.
            if inst is not None and inst.state is InstanceState.PAUSED:
                try:
                    await self._node.pause(instance_id)
                except WorkerCrashed:
                    self._mark_crashed(instance_id)

    async def _prestart(self, placeholder: str, key: str, rung: Rung, slice_id: str) -> None:
        try:
            await self._launch(placeholder, key, rung, slice_id, serve=False)
        except EmberError as err:
            # Exponential backoff (1 s doubling to 60 s), so a model whose origin is down or whose
            # code cannot load is not started (and fetched) again on every tick.
            delay = min(60.0, max(1.0, 2 * self._prestart_backoff.get(key, (0.0, 0.0))[1]))
            self._prestart_backoff[key] = (self._clock.now() + delay, delay)
            log.error("pre-start of %s failed (next try in %.0fs): %s", key, delay, err.message)
            return
        self._prestart_backoff.pop(key, None)

    def _placeable_keys(self) -> list[str]:
        """Models whose next request would be placed now without waiting (their jobs can run)."""
        snapshot = self._pool.snapshot()
        return [k for k in self._contracts if k in snapshot.models
                and not isinstance(place(k, snapshot), Wait | NoCapacity)]

    def _publish_gauges(self) -> None:
        snapshot = self._pool.snapshot()
        for key in snapshot.models:
            mine = snapshot.of_model(key)
            for state in InstanceState:
                if state is not InstanceState.STOPPED:
                    self._metrics.set_instances(key, state.value, sum(1 for i in mine if i.state is state))

    # ----- status and shutdown ------------------------------------------------------

    def status(self) -> list[ModelStatus]:
        now, snapshot = self._clock.now(), self._pool.snapshot()
        return [model_status(contract, *self._states.get(key, ("UNAVAILABLE", "")), snapshot.of_model(key),
                             self._node, now) for key, contract in sorted(self._contracts.items())]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._node.close()


def _version_order(version: str) -> tuple[int, int | str]:
    return (1, int(version)) if version.isdigit() else (0, version)


