"""The tick: sample each model's concurrency for its autoscaler, decide the lifecycle, act on it.

Collector (concurrency samples) -> deciders (`Autoscaler.decide`, `lifecycle.decide`, both pure) ->
actuation (pause, recycle, pre-start through `Instances`), as in knative's autoscaler. With a keep-alive
policy the plans' lower rungs are carried out too: templates, zygotes and store-backed models' copies in the
weight store's memory tier released and made (filled) again (`ember.core.lifecycle.KEEPS`), each in the
background, one at a time per template, zygote or model's copy. A ladder
pricing the zygote at its marginal cost is told, per model of a runtime of several, the share of the past hour
in which the others held the zygote (`ember.keepalive.zygote_share`, as the simulator does); a plan is made again
when that share moves its price enough to change it (`KeepAlivePolicy.replans`), with the pooled prior it was made
with. The pooled prior is renewed once an epoch (`ember.keepalive.pooled_prior.POOL_EPOCH_S`), as the simulator's.
The policy is called through `KeepAlivePolicy` alone, whatever its class.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

from ember.core.clock import Clock
from ember.core.lifecycle import (
    FillWeights,
    MakeTemplate,
    Pause,
    Prestart,
    Recycle,
    ReleaseTemplate,
    ReleaseWeights,
    ReleaseZygote,
    RungAction,
    Sleep,
    zygote_holders,
)
from ember.core.lifecycle import decide as decide_lifecycle
from ember.core.pool import Snapshot
from ember.core.rung_plan import IdlePlan
from ember.core.states import InstanceState, Rung
from ember.errors import EmberError
from ember.keepalive.idle_plan import KeepAlivePolicy
from ember.keepalive.pooled_prior import POOL_EPOCH_S, PooledPrior
from ember.keepalive.zygote_share import ZygoteShares
from ember.serving.deployments import Deployment, Deployments
from ember.serving.instances import Instances, Spawn
from ember.serving.ports import LadderMetrics
from ember.serving.warmpool import WarmPool
from ember.wire.contract import ModelContract

MEMORY_EVERY_S = 5.0

log = logging.getLogger("ember.controller")


class Actuator:
    def __init__(self, instances: Instances, deployments: Deployments, metrics: LadderMetrics, clock: Clock,
                 spawn: Spawn, keepalive: KeepAlivePolicy | None = None, warm_pool: WarmPool | None = None) -> None:
        self._instances, self._pool = instances, instances.pool
        self._deployments, self._metrics, self._clock = deployments, metrics, clock
        self._spawn, self._keepalive, self._warm_pool = spawn, keepalive, warm_pool
        self._memory_at = 0.0
        self._rung_tasks: set[str] = set()   # "template:KEY" / "zygote:RUNTIME" / "weights:KEY" being released or made
        self._zygote_shares = ZygoteShares()
        # The pooled prior of the current epoch (`POOL_EPOCH_S` from the actuator's start), as the simulator renews it.
        self._started = clock.now()
        self._pooled_prior: tuple[int, PooledPrior | None] = (0, None)

    def tick(self) -> None:
        now = self._clock.now()
        desired, scale = self._autoscale(now)
        deployments = {d.key: d for d in self._deployments.all() if d.key in self._pool.models}
        idle = {k: now - d.last_done for k, d in deployments.items() if d.last_done is not None}
        snapshot = self._pool.snapshot()
        self._renew_pooled(now, deployments)
        plans = self._plans(deployments, self._zygote_others(snapshot, now, deployments, idle))
        zygotes = self._zygotes() if plans is not None else None
        actions = decide_lifecycle(snapshot, now, desired, plans, idle, zygotes, scale)
        if self._warm_pool is not None:   # idle capacity within the node's budget, sized by the LP planner
            actions = self._warm_pool.adjust(snapshot, now, deployments, actions)
        for action in actions:
            if isinstance(action, Pause):
                self._pool.transition(action.instance_id, InstanceState.PAUSED, now)
                self._spawn(self._instances.pause(action.instance_id))
            elif isinstance(action, Sleep):
                self._pool.transition(action.instance_id, InstanceState.ASLEEP, now)
                self._spawn(self._instances.sleep(action.instance_id, action.level))
            elif isinstance(action, Recycle):
                log.info("recycling %s: %s", action.instance_id, action.reason)
                self._pool.transition(action.instance_id, InstanceState.DRAINING, now)
                self._spawn(self._instances.retire(action.instance_id))
            elif isinstance(action, Prestart):
                deployment = deployments.get(action.model)
                if deployment is None or now < deployment.retry_at:
                    continue  # its last pre-start failed: do not retry on every tick
                placeholder, rung = self._instances.reserve(action.model, action.rung, action.slice_id)
                self._spawn(self._prestart(deployment, placeholder, rung, action.slice_id))
            else:
                self._rungs(action, deployments)
        self._pool.forget_stopped()
        self._publish_gauges()

    def _zygotes(self) -> set[str]:
        """Runtimes whose zygote is up, or on its way up (a zygote being released counts as gone)."""
        node = self._instances.node
        runtimes = {info.runtime for info in self._pool.models.values()}
        making = {t.removeprefix("zygote:") for t in self._rung_tasks if t.startswith("zygote:")}
        return {r for r in runtimes if (node.has_zygote(r) and self._ready(r)) or r in making}

    def _ready(self, runtime: str) -> bool:
        return all(i.runtime_ready for i in self._pool.models.values() if i.runtime == runtime)

    def _rungs(self, action: RungAction, deployments: dict[str, Deployment]) -> None:
        """Carry out a plan's lower rung: book it in the pool now (so no start is sent to what goes), act later."""
        instances = self._instances
        if isinstance(action, ReleaseWeights | FillWeights):
            self._weights(action, deployments)
        elif isinstance(action, ReleaseTemplate | MakeTemplate):
            deployment = deployments.get(action.model)
            if deployment is None or f"template:{action.model}" in self._rung_tasks:
                return
            if isinstance(action, ReleaseTemplate):
                deployment.released = True
                self._book(action.model, has_template=False)
                self._background(f"template:{action.model}", lambda: self._release_template(deployment))
            elif self._clock.now() >= deployment.retry_at:
                self._background(f"template:{action.model}", lambda: self._make_template(deployment))
        elif f"zygote:{action.runtime}" not in self._rung_tasks:
            runtime = action.runtime
            if isinstance(action, ReleaseZygote):
                instances.set_runtime_ready(runtime, False)
                self._background(f"zygote:{runtime}", lambda: self._release_zygote(runtime))
            else:
                self._background(f"zygote:{runtime}", lambda: self._make_zygote(runtime))

    def _weights(self, action: ReleaseWeights | FillWeights, deployments: dict[str, Deployment]) -> None:
        """A model's copy in the memory tier: booked released (or not) now, removed (or filled) behind."""
        deployment = deployments.get(action.model)
        if deployment is None or f"weights:{action.model}" in self._rung_tasks:
            return
        contract = deployment.contract
        self._book(action.model, weights_released=isinstance(action, ReleaseWeights))
        if isinstance(action, ReleaseWeights):
            keep = [deployments[k].contract for k in sorted(action.keep) if k in deployments]
            self._background(f"weights:{action.model}", lambda: self._release_weights(contract, keep))
        else:
            self._background(f"weights:{action.model}", lambda: self._fill_weights(contract))

    async def _release_weights(self, contract: ModelContract, keep: list[ModelContract]) -> None:
        freed = await self._instances.node.release_weights(contract, keep)
        log.info("%s: %.1f MB released from the memory tier (keep-alive plan)", contract.key, freed / 2**20)
        self._metrics.instance_event(contract.key, "release_weights")

    async def _fill_weights(self, contract: ModelContract) -> None:
        await self._instances.node.fill_weights(contract)
        self._metrics.instance_event(contract.key, "fill_weights")

    def _background(self, tag: str, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._rung_tasks.add(tag)

        async def run() -> None:
            try:
                await work()
            except EmberError as err:
                log.error("%s: %s", tag, err.message)
            except Exception:   # a bug: logged with its traceback, never lost in a task nobody awaits
                log.exception("%s: failed", tag)
            finally:
                self._rung_tasks.discard(tag)

        self._spawn(run())

    def _book(self, key: str, **changes: Any) -> None:
        """Set the pool's record of what the node holds of a model (gone meanwhile: nothing)."""
        info = self._pool.models.get(key)
        if info is not None:
            self._pool.models[key] = replace(info, **changes)

    async def _release_template(self, deployment: Deployment) -> None:
        key = deployment.key
        if await self._instances.node.release_template(key):
            log.info("%s: template released (keep-alive plan)", key)
            self._metrics.instance_event(key, "release_template")
        else:   # an instance was forked from it meanwhile: it stays
            deployment.released = False
            self._book(key, has_template=self._instances.node.has_template(key))

    async def _make_template(self, deployment: Deployment) -> None:
        try:
            await self._instances.node.prepare(deployment.contract)
        except EmberError as err:
            self._back_off(deployment, f"{deployment.key}: cannot make the template again", err)
            return
        self._instances.remade(deployment.key)
        self._metrics.instance_event(deployment.key, "make_template")
        log.info("%s: template made again (keep-alive plan)", deployment.key)

    async def _release_zygote(self, runtime: str) -> None:
        if await self._instances.node.release_zygote(runtime):
            log.info("runtime %s: zygote released (keep-alive plan)", runtime)
        else:
            self._instances.set_runtime_ready(runtime, self._instances.node.has_zygote(runtime))

    async def _make_zygote(self, runtime: str) -> None:
        await self._instances.node.start_zygote(runtime)
        self._instances.set_runtime_ready(runtime, True)
        log.info("runtime %s: zygote started again (keep-alive plan)", runtime)

    def _autoscale(self, now: float) -> tuple[dict[str, int], dict[str, int]]:
        """Per model: what to pre-start for (the KPA's desire under load or until its initial scale is reached),
        and the KPA's desire whatever the load, which idle instances beyond are recycled (its scale-down)."""
        desired, scale = {}, {}
        snapshot = self._pool.snapshot()
        for deployment in self._deployments.all():
            if deployment.autoscaler is None:
                continue
            mine = snapshot.of_model(deployment.key)
            # Requests in instances, plus those waiting for room: what the instances are asked to hold.
            concurrency = sum(i.inflight for i in mine) + deployment.waiting
            deployment.autoscaler.record(now, float(concurrency))
            ready = sum(1 for i in mine if i.state is not InstanceState.STARTING)
            decision = deployment.autoscaler.decide(now, ready)
            # Pre-start for the autoscaler only under load (or to reach the initial scale at deploy): idle
            # capacity is the keep-alive's call. Scale-down follows the desire at any load.
            under_load = concurrency > 0 or decision.reason == "initial"
            desired[deployment.key] = decision.desired if under_load else 0
            if deployment.failing:   # its last start failed: one is tried again (backing off), so readiness recovers
                desired[deployment.key] = max(1, desired[deployment.key])
            scale[deployment.key] = decision.desired
            self._metrics.set_load(deployment.key, concurrency, deployment.waiting, desired[deployment.key],
                                   decision.panic)
        return desired, scale

    def _zygote_others(self, snapshot: Snapshot, now: float, deployments: dict[str, Deployment],
                       idle: dict[str, float]) -> dict[str, float | None]:
        """Per model of a runtime of several, the share of the past hour in which another model of it held the
        zygote (None before a whole minute), for a ladder pricing the zygote at its marginal cost; else none, as
        in the simulator (`ember.sim.engine`). Each tick is an observation of who holds it
        (`ember.core.lifecycle.zygote_holders`: by the plans at the even split, the simulator's first pass)."""
        policy = self._keepalive
        if policy is None or not policy.prices_zygote_share():
            return {}
        plans = {k: p for k, d in deployments.items() if (p := d.even_plan or d.plan) is not None}
        holders = zygote_holders(snapshot, plans, idle)
        self._zygote_shares = self._zygote_shares.observe(
            now, {k: (info.runtime, k in holders) for k, info in snapshot.models.items()})
        models_of = Counter(info.runtime for info in snapshot.models.values())
        return {k: self._zygote_shares.share(k) for k in deployments if models_of[snapshot.models[k].runtime] > 1}

    def _plans(self, deployments: dict[str, Deployment],
               zygote_others: dict[str, float | None]) -> dict[str, IdlePlan] | None:
        if self._keepalive is None:
            return None
        plans = {}
        prior = self._pooled_prior[1]
        for key, deployment in deployments.items():
            others, policy = zygote_others.get(key), self._priced(self._keepalive, key)
            if deployment.plan is not None and others != deployment.plan_zygote_others:
                if policy.replans(deployment.plan, deployment.plan_zygote_others, others):
                    deployment.plan = None
                else:   # the plan is the same at the new share: checked once, not on every tick until it moves
                    deployment.plan_zygote_others = others
            if deployment.plan is None:
                if deployment.history is None:
                    deployment.history = policy.new_history()
                if deployment.even_plan is None:
                    # The epoch's pooled prior (`_renew_pooled`; none for a policy that pools none), as the idle
                    # period begins: a repricing keeps it (only the zygote's share moved).
                    deployment.plan_prior = prior
                    deployment.even_plan = policy.plan(deployment.history, prior)
                deployment.plan = (deployment.even_plan if others is None
                                   else policy.plan(deployment.history, deployment.plan_prior, others))
                deployment.plan_zygote_others = others
            plans[key] = deployment.plan
        return plans

    def _priced(self, policy: KeepAlivePolicy, key: str) -> KeepAlivePolicy:
        """The policy as model `key` pays: a ladder prices a store-backed model's copy in the memory tier on the
        zygote rung (the rungs above map it, the plan's FETCH releases it: `ReleaseWeights`)."""
        info = self._pool.models.get(key)
        if info is None or info.memory_copy_mb <= 0:
            return policy
        return policy.with_memory_copy(info.memory_copy_mb)

    def _renew_pooled(self, now: float, deployments: dict[str, Deployment]) -> None:
        """At the first tick of each epoch of `POOL_EPOCH_S` from the actuator's start, the pooled prior of every
        model's history then (`_pooled`): the plans of the epoch's idle periods use it, as the simulator's refresh
        points use their epoch's (`ember.sim.pooled`); the first epoch pools none. Renewed per epoch, not per
        tick, a plan does not depend on where the tick after its arrival falls (other models' replies between)."""
        policy = self._keepalive
        epoch = int(max(0.0, now - self._started) // POOL_EPOCH_S)
        if epoch == self._pooled_prior[0] or policy is None:
            return
        self._pooled_prior = (epoch, self._pooled(policy, deployments))

    def _pooled(self, policy: KeepAlivePolicy, deployments: dict[str, Deployment]) -> PooledPrior | None:
        """The pooled prior of every model's history on the node, each idle model's idle time so far censored: a
        model serving (a request in an instance, starting one, or waiting for room), or one whose plan an arrival
        dropped (`ember.serving.requests`; its reply may have come before this tick), is not idle: the period its
        arrival ended is in its history already."""
        now = self._clock.now()
        snapshot = self._pool.snapshot()
        kept = [d for d in deployments.values() if d.history is not None]

        def idle_s(d: Deployment) -> float | None:
            busy = d.waiting > 0 or any(i.inflight or i.state is InstanceState.STARTING
                                        for i in snapshot.of_model(d.key))
            begun = d.even_plan is None   # an arrival dropped its plan (a repricing keeps the even split's)
            return None if d.last_done is None or busy or begun else max(0.0, now - d.last_done)

        return policy.pool([d.history.table() for d in kept if d.history is not None], [idle_s(d) for d in kept])

    async def _prestart(self, deployment: Deployment, placeholder: str, rung: Rung, slice_id: str) -> None:
        try:
            await self._instances.launch(placeholder, deployment.key, rung, slice_id, serve=False)
        except EmberError as err:
            self._back_off(deployment, f"pre-start of {deployment.key} failed", err)
            return
        deployment.retry_at, deployment.retry_delay_s = 0.0, 0.0

    def _back_off(self, deployment: Deployment, what: str, err: EmberError) -> None:
        """Exponential backoff (1 s doubling to 60 s), so a model whose origin is down or whose code cannot load
        is not started (and fetched) again on every tick."""
        deployment.retry_delay_s = min(60.0, max(1.0, 2 * deployment.retry_delay_s))
        deployment.retry_at = self._clock.now() + deployment.retry_delay_s
        log.error("%s (next try in %.0fs): %s", what, deployment.retry_delay_s, err.message)

    def _publish_gauges(self) -> None:
        snapshot = self._pool.snapshot()
        now = self._clock.now()
        measure = now >= self._memory_at   # PSS reads every process's smaps: not on every tick
        if measure:
            self._memory_at = now + MEMORY_EVERY_S
            usage = self._instances.node.store_usage()
            self._metrics.set_store(usage.tier_bytes, usage.fetched_bytes, usage.fetch_s)
        for key in snapshot.models:
            mine = snapshot.of_model(key)
            for state in InstanceState:
                if state is not InstanceState.STOPPED:
                    self._metrics.set_instances(key, state.value, sum(1 for i in mine if i.state is state))
            if measure:
                self._metrics.set_memory(key, self._pss(key, [i.id for i in mine if i.state is not
                                                              InstanceState.STARTING]))

    def _pss(self, key: str, instance_ids: list[str]) -> int:
        """PSS of the model's template and instances (those that left meanwhile count nothing)."""
        node, total = self._instances.node, 0
        for instance_id in instance_ids:
            with contextlib.suppress(EmberError, OSError, KeyError):
                total += node.memory(instance_id).pss_bytes
        with contextlib.suppress(EmberError, OSError):
            template = node.template_memory(key)
            total += template.pss_bytes if template is not None else 0
        return total

