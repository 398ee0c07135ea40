"""The controller: the `Service` behind the gateway, wiring the serving core's parts together.

    Deployments (one record per model)      deployments.py
    Instances (start, resume, pause, stop)  instances.py
    RequestPath (claim, send, settle)       requests.py
    Actuator (the tick: autoscale, pause, recycle, pre-start)   actuator.py
    Healer (a lost template: serve from the zygote, make it again) healer.py
    JobRunner (durable jobs, run as soon as there is room)      jobs.py

Decisions are taken and recorded in the pool synchronously, before any await, so two requests can
never claim the same room or slice.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from typing import Any

from ember.core.autoscaler import Autoscaler, AutoscalerConfig
from ember.core.clock import Clock
from ember.core.pool import ModelInfo, Pool, Snapshot
from ember.core.scheduler import NoCapacity, Wait, place
from ember.core.slices import Slice
from ember.core.states import InstanceState
from ember.core.throughput import drain_s, expected_wait_s
from ember.core.warm_pool import WarmPoolSettings
from ember.errors import EmberError, InvalidInput, JobStoreError, ModelNotFound, ModelNotReady, Overloaded
from ember.keepalive.idle_plan import KeepAlivePolicy
from ember.node.api import Node, collect
from ember.serving.actuator import Actuator
from ember.serving.deployments import Deployment, Deployments, ModelState
from ember.serving.healer import Healer
from ember.serving.instances import Instances
from ember.serving.jobs import JobRunner
from ember.serving.ports import IdleForecast, JobQueue, LadderMetrics, Tracer
from ember.serving.ports import NoCapacity as NoCapacityNow
from ember.serving.repository import Repository
from ember.serving.requests import RequestPath, RequestSettings
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
from ember.serving.status import model_status
from ember.serving.warmpool import WarmPool
from ember.wire.contract import ModelContract, Resources
from ember.wire.tensors import Tensors

log = logging.getLogger("ember.controller")


@dataclass(frozen=True)
class ControllerSettings:
    request_timeout_s: float = 60.0
    queue_wait_s: float = 2.0        # how long a request waits for room before becoming a job
    overload_wait_s: float = 10.0    # how long a request that must not become a job waits before a 429
    tick_s: float = 0.25
    job_retry_after_s: float = 2.0   # a 202's Retry-After before the model's throughput is known
    store_retry_s: float = 0.1       # first wait before writing a job's result again (doubling up to the max)
    store_retry_max_s: float = 5.0
    # The job store is shared with other nodes (PostgreSQL): which models exist is then no one node's to
    # say, so a model this node lacks or unloads keeps its queued jobs for the nodes that serve it.
    shared_jobs: bool = False
    # None: each model follows its contract's pause_after_s / max_idle_s. Otherwise the same
    # policy object the simulator evaluates decides each model's idle rung from its history.
    keepalive: KeepAlivePolicy | None = None
    # With a node budget for idle memory: the LP buffer planner sizes each model's idle instances within it,
    # by `forecast` (the ladder's, `ember.keepalive.arrivals.LadderForecast`; needed with a warm pool). Each
    # model's idle history is the policy's, else the forecast's (neither: none is kept).
    warm_pool: WarmPoolSettings | None = None
    forecast: IdleForecast | None = None
    # The most tensor bytes one collected answer may carry (the server's max_inflight_mb; None: no bound).
    max_reply_bytes: int | None = None


def _warm_pool(settings: ControllerSettings) -> WarmPool | None:
    if settings.warm_pool is None:
        return None
    if settings.forecast is None:
        raise InvalidInput("a warm pool (warm_pool) needs an idle forecast (forecast)")
    return WarmPool(settings.warm_pool, settings.forecast)


class Controller:
    def __init__(self, node: Node, jobs: JobQueue, metrics: LadderMetrics, clock: Clock,
                 slices: list[Slice], repository: Repository, settings: ControllerSettings | None = None,
                 tracer: Tracer | None = None) -> None:
        self._node, self._jobs, self._clock = node, jobs, clock
        self._settings = s = settings or ControllerSettings()
        self._repo = repository
        self._pool = Pool(slices=tuple(slices))
        self._deployments = Deployments()
        self._tasks: set[asyncio.Task[None]] = set()
        self._instances = Instances(self._pool, node, self._deployments, metrics, clock)
        self._requests = RequestPath(self._instances, self._deployments, metrics, clock, self._spawn,
                                     RequestSettings(s.request_timeout_s, s.queue_wait_s), s.keepalive or s.forecast,
                                     tracer)
        self._actuator = Actuator(self._instances, self._deployments, metrics, clock, self._spawn, s.keepalive,
                                  _warm_pool(s))
        self._healer = Healer(self._pool, node, self._deployments, clock, self._spawn)
        # A running job's lease: twice the request timeout (a live request ends by then, answered or 504).
        self._runner = JobRunner(jobs, metrics, self, self._spawn, clock, lease_s=2 * s.request_timeout_s,
                                 retry_first_s=s.store_retry_s, retry_max_s=s.store_retry_max_s,
                                 shared=s.shared_jobs)
        self._instances.on_room(self._runner.poke)

    # ----- deployment -------------------------------------------------------------

    async def deploy_all(self) -> None:
        """Deploy every valid contract; bad ones stay listed as UNAVAILABLE. A node with no slices (a gateway only)
        deploys none: it offers them to its cluster (`offered`)."""
        await asyncio.to_thread(self._repo.fetch)   # contract directories in the weight store, written out here
        if not self._pool.slices:
            log.info("no slices on this node: a gateway only; its models are offered to the cluster, not deployed")
            return
        for entry in self._repo.scan():
            if entry.contract is None:
                log.error("skipping %s: %s", entry.path, entry.error)
                self._deployments.unavailable(entry.name, entry.error or "invalid contract")
                continue
            with contextlib.suppress(EmberError):
                await self.deploy(entry.contract)
        entries = self._repo.scan()
        await self._runner.recover(known=[(e.contract.name, e.contract.version) for e in entries if e.contract],
                                   invalid=[e.name for e in entries if e.contract is None])

    async def deploy(self, contract: ModelContract) -> None:
        key = contract.key
        deployment = self._deployments.add(contract)
        try:   # a contract from the weight store is read out of this node's own store, never another's path
            if contract.bundle is not None:
                contract = deployment.contract = await asyncio.to_thread(self._repo.localize, contract)
        except EmberError as err:
            deployment.state, deployment.reason = ModelState.UNAVAILABLE, err.message
            log.error("cannot deploy %s: %s", key, err.message)
            raise
        res = contract.resources
        why_not = self._no_slice(res)
        if why_not is not None:
            deployment.state, deployment.reason = ModelState.UNAVAILABLE, why_not
            log.error("cannot deploy %s: %s", key, deployment.reason)
            raise ModelNotReady(f"{key}: {deployment.reason}")
        try:
            await self._node.prepare(contract)
        except EmberError as err:
            deployment.state, deployment.reason = ModelState.UNAVAILABLE, err.message
            log.error("cannot deploy %s: %s", key, err.message)
            raise
        s, backed = contract.scaling, self._node.store_backed(contract)
        self._pool.models[key] = ModelInfo(
            key=key, slice_kind=res.slice, memory_mb=res.memory_mb, min_scale=s.min_scale, max_scale=s.max_scale,
            target_concurrency=s.target_concurrency, pause_after_s=s.pause_after_s, max_idle_s=s.max_idle_s,
            has_template=self._node.has_template(key), weights_local=self._node.weights_local(contract),
            max_concurrency=contract.max_concurrency, runtime=contract.runtime, keep_template=s.keep_template,
            runtime_ready=self._node.has_zygote(contract.runtime), store_backed=backed,
            memory_copy_mb=self._copy_mb(contract) if backed else 0.0, sleep_after_s=s.sleep_after_s,
            sleep_level=s.sleep_level, dedicated=res.dedicated_cores)
        deployment.autoscaler = Autoscaler(AutoscalerConfig.from_contract(contract), created_at=self._clock.now())
        deployment.state = ModelState.READY
        log.info("deployed %s (template: %s)", key, self._node.has_template(key))

    def _no_slice(self, res: Resources) -> str | None:
        """Why no slice of this node could ever hold one of the model's instances (None: one could)."""
        eligible = self._pool.snapshot().slices_for(res.slice, res.dedicated_cores)
        if res.dedicated_cores and not eligible:
            return "resources.dedicated_cores: this node has no dedicated CPU slot (ember serve --dedicated-cpu-slots)"
        if not any(s.fits(res.slice, res.memory_mb) for s in eligible):
            return f"resources: no {res.slice} slice on this node holds {res.memory_mb} MB"
        return None

    def _copy_mb(self, contract: ModelContract) -> float:
        """The MB (MiB, as PSS is counted) of the store-backed model's chunks, as its memory-tier copy holds them."""
        size = self._node.weights_size(contract)
        return 0.0 if size is None else size[0] / 2**20

    async def undeploy(self, key: str) -> None:
        self._pool.models.pop(key, None)
        now = self._clock.now()
        mine = self._pool.snapshot().of_model(key)
        # Its slices stay booked (DRAINING) until the processes are gone: another model started
        # there meanwhile could find the memory still taken.
        for inst in mine:
            if inst.state is not InstanceState.DRAINING:
                self._pool.transition(inst.id, InstanceState.DRAINING if inst.state is not InstanceState.STARTING
                                      else InstanceState.STOPPED, now)
        self._instances.wake()  # waiting requests learn the model is gone
        try:
            await self._node.release(key)
        finally:
            for inst in mine:
                self._pool.stopped(inst.id, self._clock.now())
            self._deployments.remove(key, "unloaded")
            self._instances.wake()

    # ----- Service: models ------------------------------------------------------------

    def contracts(self) -> list[ModelContract]:
        return [d.contract for d in self._deployments.ready()]

    def contract(self, name: str, version: str | None = None) -> ModelContract:
        return self._deployments.find(name, version).contract

    def model_ready(self, name: str, version: str | None = None) -> bool:
        try:
            return self._serves(self._deployments.find(name, version))
        except ModelNotFound:
            return False

    def server_ready(self) -> bool:
        """Nothing still loading, and at least one model able to serve (failed ones do not block)."""
        deployments = self._deployments.all()
        return (all(d.state is not ModelState.LOADING for d in deployments)
                and any(self._serves(d) for d in deployments))

    def _serves(self, deployment: Deployment) -> bool:
        """READY, and a request can be served: its last start succeeded, or an instance of it (running, paused
        or asleep) takes the request without a start."""
        if not deployment.ready:
            return False
        return not deployment.failing or any(i.state.ready or i.state.resting
                                             for i in self._pool.snapshot().of_model(deployment.key))

    def deploying(self) -> int:
        """Models still loading (a deploy in progress; failed ones are not)."""
        return sum(1 for d in self._deployments.all() if d.state is ModelState.LOADING)

    def repository_index(self) -> list[RepositoryEntry]:
        out = []
        for entry in self._repo.scan():
            if entry.contract is None:
                out.append(RepositoryEntry(entry.name, "", "UNAVAILABLE", entry.error or "", tenant=""))
                continue
            state, reason = self._deployments.state_of(entry.contract.key)
            out.append(RepositoryEntry(entry.contract.name, entry.contract.version, state.value, reason,
                                       entry.contract.tenant))
        return out

    async def load_model(self, name: str) -> None:
        """Deploy `name` again from the repository (its file read again). A node with no slices (a gateway only)
        deploys nothing: the contract, once valid, is offered to the cluster as it is (`offered`)."""
        await asyncio.to_thread(self._repo.fetch)   # a store object that could not be fetched before is tried again
        contracts = self._repo.find(name)
        if not self._pool.slices:
            return
        for contract in contracts:
            if contract.key in self._pool.models:
                await self.undeploy(contract.key)
            await self.deploy(contract)

    async def unload_model(self, name: str) -> None:
        keys = [d.key for d in self._deployments.all() if d.contract.name == name]
        if not keys:
            raise ModelNotFound(f"model '{name}' is not loaded")
        for key in keys:
            await self.undeploy(key)
        await self._runner.fail_model(name)

    def job(self, job_id: str) -> JobStatus:
        return self._jobs.get(job_id)

    # ----- Service: requests -------------------------------------------------------

    async def infer(self, contract: ModelContract, inputs: Tensors, *, respond_async: bool = False,
                    when_full: WhenFull = "job", tenant: str | None = None,
                    idempotency_key: str | None = None) -> InferResult | JobAccepted:
        """Serve and collect every reply. No room: a job (`when_full="job"`; `tenant`'s) or, after waiting longer
        for room, Overloaded carrying the queue's expected wait (`"reject"`: clients that cannot poll a job).
        An `idempotency_key` that already names a live job of this model answers that job."""
        if idempotency_key is not None:
            earlier = await self._runner.existing(contract, inputs, idempotency_key, tenant)
            if earlier is not None:
                return earlier
        if respond_async:
            self._check_ready(contract)
            return await self._runner.submit(contract, inputs, tenant, idempotency_key)
        try:
            stream = await self.stream(contract, inputs, when_full=when_full, tenant=tenant)
        except NoCapacityNow:
            return await self._runner.submit(contract, inputs, tenant, idempotency_key)
        return InferResult(await collect(stream, self._settings.max_reply_bytes), stream.rung, stream.instance_id)

    async def stream(self, contract: ModelContract, inputs: Tensors, *, when_full: WhenFull = "reject",
                     tenant: str | None = None, on_claim: OnClaim | None = None) -> InferStream:
        """The request's replies as they come (`tenant`: the caller's, None: none). No room within the wait:
        Overloaded (NoCapacity with "job")."""
        self._check_ready(contract)
        wait_s = self._settings.overload_wait_s if when_full == "reject" else None
        try:
            return await self._requests.open(contract.key, inputs, wait_s=wait_s, tenant=tenant, on_claim=on_claim)
        except NoCapacityNow as err:
            if when_full != "reject":
                raise
            ahead = self._deployments.find(contract.name, contract.version).waiting
            raise Overloaded(f"model '{contract.key}': every instance is full ({err})",
                             retry_after=self.retry_after(contract.key, ahead)) from None

    def _check_ready(self, contract: ModelContract) -> None:
        state, reason = self._deployments.state_of(contract.key)
        if state is not ModelState.READY:
            raise ModelNotReady(f"model '{contract.name}' is not ready: {reason or state.value.lower()}")

    # ----- the cluster's view of this node (ember/cluster/inventory.py) ------------------

    @property
    def node(self) -> Node:
        return self._node

    def snapshot(self) -> Snapshot:
        """The pool now: instances, slices, deployed models."""
        return self._pool.snapshot()

    def offered(self) -> list[ModelContract]:
        """The models this node offers its cluster: those deployed here; on a node with no slices (a gateway only,
        `--cpu-slots 0`) the valid contracts of its repository, which it never deploys itself."""
        if self._pool.slices:
            return self.contracts()
        return [e.contract for e in self._repo.scan() if e.contract is not None]

    def has_deployment(self, key: str) -> bool:
        """The model is deployed here, or its deploy is under way: a second one would replace it. A deploy that
        failed is none (a take-up tries it again, else the model's jobs would wait on this node for ever)."""
        deployment = self._deployments.get(key)
        return deployment is not None and deployment.state is not ModelState.UNAVAILABLE

    def has_models(self) -> bool:
        """Some model was deployed here (or is loading, or failed to): readiness is then this node's own."""
        return bool(self._deployments.all())

    def set_min_scale(self, key: str, n: int) -> bool:
        """This node's share of a model's min scale (the cluster spreads the contract's over its nodes,
        `ember.core.min_scale`), bounded by the model's max scale; False when the model is not deployed here or
        already has it."""
        info, deployment = self._pool.models.get(key), self._deployments.get(key)
        if info is None or deployment is None or deployment.autoscaler is None:
            return False
        n = min(max(0, n), info.max_scale) if info.max_scale else max(0, n)
        if info.min_scale == n:
            return False
        self._pool.models[key] = replace(info, min_scale=n)
        cfg = deployment.autoscaler.config
        deployment.autoscaler.config = cfg.model_copy(update={"min_scale": n})
        log.info("%s: min scale on this node %d (its share of the cluster's)", key, n)
        return True

    def queued_jobs(self) -> dict[str, int]:
        """Durable jobs queued per model key, as the job store last said (a shared store: every node's)."""
        return dict(self._runner.queued_by_model)

    def waiting(self) -> int:
        """Requests waiting for room, all models together: the node's queue in the cluster's placement."""
        return sum(d.waiting for d in self._deployments.all())

    def queue_s(self, unmeasured_s: float) -> float:
        """Seconds to work through the requests waiting for room: each model's waiting requests over the rate its
        instances completed requests at lately, over a second at least (waiting for room, they are saturated:
        that rate is their capacity); `unmeasured_s` per request of a model with no rate measured yet."""
        now = self._clock.now()
        return sum(drain_s(d.waiting, d.served.rate(now, min_span_s=1.0), unmeasured_s)
                   for d in self._deployments.all() if d.waiting)

    def has_room(self, key: str) -> bool:
        """A ready instance of `key` on this node holds fewer requests than it may: a local hot rung."""
        snapshot = self._pool.snapshot()
        info = snapshot.models.get(key)
        return info is not None and any(i.state.ready and i.inflight < info.per_instance
                                        for i in snapshot.of_model(key))

    async def submit_job(self, contract: ModelContract, inputs: Tensors, tenant: str | None = None,
                         idempotency_key: str | None = None) -> JobAccepted:
        """A durable job for a model this node need not serve: with a shared store, a node serving it claims it."""
        return await self._runner.submit(contract, inputs, tenant, idempotency_key)

    # ----- JobHost -------------------------------------------------------------------

    async def serve(self, key: str, inputs: Tensors, tenant: str | None = None) -> Tensors:
        return await collect(await self._requests.open(key, inputs, tenant=tenant), self._settings.max_reply_bytes)

    def room(self) -> dict[str, int]:
        snapshot = self._pool.snapshot()
        room = {}
        for key, info in snapshot.models.items():
            decision = place(key, snapshot)
            if isinstance(decision, Wait | NoCapacity):
                continue
            mine = [i for i in snapshot.of_model(key) if i.state.ready or i.state.resting]
            free = sum(max(0, info.per_instance - i.inflight) for i in mine)
            room[key] = max(1, free)   # a start or an eviction: at least the one that triggers it
        return room

    def retry_after(self, key: str, ahead: int) -> float:
        deployment = self._deployments.get(key)
        rate = deployment.served.rate(self._clock.now()) if deployment is not None else None
        return expected_wait_s(ahead, rate, self._settings.job_retry_after_s)

    # ----- background: ticks -----------------------------------------------------------

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
        self._healer.tick()
        self._actuator.tick()
        await self._runner.refresh()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        # A fresh context: background work (a job, a pause) belongs to no request's trace, even when a
        # request's end is what set it off.
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ----- status and shutdown ------------------------------------------------------

    async def node_status(self) -> dict[str, Any]:
        zygotes = [{"runtime": runtime, "pid": m.pid, "rss_bytes": m.rss_bytes, "pss_bytes": m.pss_bytes}
                   for runtime, m in sorted(self._node.zygote_memory().items())]
        try:
            stats = await asyncio.to_thread(self._jobs.queued_stats)
        except JobStoreError as err:   # the status page must not fail with the store
            return {"zygotes": zygotes, "jobs": [], "job_store": err.message}
        jobs = [{"model": name, "version": version, "queued": n, "oldest_age_s": round(age, 3)}
                for (name, version), (n, age) in sorted(stats.items())]
        health = "ok" if self._runner.healthy else "failing"
        damage = getattr(self._jobs, "damage", None)   # found at open: said until the server restarts
        return {"zygotes": zygotes, "jobs": jobs, "job_store": health if damage is None else f"{health}; {damage}",
                "snapshots": self._node.snapshot_status()}

    def status(self) -> list[ModelStatus]:
        now, snapshot = self._clock.now(), self._pool.snapshot()
        out = []
        for deployment in sorted(self._deployments.all(), key=lambda d: d.key):
            out.append(model_status(deployment.contract, deployment.state.value, deployment.explained,
                                    snapshot.of_model(deployment.key), self._node, now))
        deployed = {d.contract.name for d in self._deployments.all()} | {d.key for d in self._deployments.all()}
        for name, reason in sorted(self._deployments.failed().items()):
            if name not in deployed:   # a contract that never parsed, or an unloaded model
                model, _, version = name.partition(":")
                out.append(ModelStatus(model, version, f"{ModelState.UNAVAILABLE.value}: {reason}", None, []))
        return out

    def stop_claiming(self) -> None:
        """A shutdown has begun (SIGTERM): claim no more jobs. Only sets a flag (safe in a signal handler)."""
        self._runner.stop_claiming()

    async def drain(self, timeout_s: float) -> list[str]:
        """Claim no more jobs and wait up to `timeout_s` for the running ones to finish (the tick must go on
        meanwhile); the jobs still running then (close() puts them back in the queue)."""
        running = self._runner.running
        if running:
            log.info("shutting down: waiting up to %.1f s for %d running job(s) to finish", timeout_s, len(running))
        left = await self._runner.drain(timeout_s)
        if running:
            log.info("shutting down: %d job(s) finished, %d still running", len(set(running) - set(left)),
                     len(left))
        return left

    async def close(self) -> None:
        """Stop everything at once: background work is cancelled, jobs still running go back to the queue in
        their place (they run again: on the next start, or on another node), instances are stopped."""
        cut = self._runner.running
        self._runner.stop_claiming()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if cut:
            back = await self._runner.give_back(cut)
            log.warning("shutting down: %d running job(s) cut off, %d put back in the queue (they run again)",
                        len(cut), back)
        await self._node.close()
