"""The tick: sample each model's concurrency for its autoscaler, decide the lifecycle, act on it.

Collector (concurrency samples) -> deciders (`Autoscaler.decide`, `lifecycle.decide`, both pure) ->
actuation (pause, recycle, pre-start through `Instances`), as in knative's autoscaler.
"""

from __future__ import annotations

import contextlib
import logging

from ember.core.clock import Clock
from ember.core.keepalive import IdlePlan, KeepAlivePolicy
from ember.core.lifecycle import Pause, Prestart, Recycle
from ember.core.lifecycle import decide as decide_lifecycle
from ember.core.states import InstanceState, Rung
from ember.errors import EmberError
from ember.serving.deployments import Deployment, Deployments
from ember.serving.instances import Instances, Spawn
from ember.serving.ports import LadderMetrics
from ember.serving.warmpool import WarmPool

MEMORY_EVERY_S = 5.0

log = logging.getLogger("ember.controller")


class Actuator:
    def __init__(self, instances: Instances, deployments: Deployments, metrics: LadderMetrics, clock: Clock,
                 spawn: Spawn, keepalive: KeepAlivePolicy | None = None, warm_pool: WarmPool | None = None) -> None:
        self._instances, self._pool = instances, instances.pool
        self._deployments, self._metrics, self._clock = deployments, metrics, clock
        self._spawn, self._keepalive, self._warm_pool = spawn, keepalive, warm_pool
        self._memory_at = 0.0

    def tick(self) -> None:
        now = self._clock.now()
        desired = self._autoscale(now)
        deployments = {d.key: d for d in self._deployments.all() if d.key in self._pool.models}
        plans = self._plans(deployments)
        idle = {k: now - d.last_done for k, d in deployments.items() if d.last_done is not None}
        actions = decide_lifecycle(self._pool.snapshot(), now, desired, plans, idle)
        if self._warm_pool is not None:   # idle capacity within the node's budget, sized by the LP planner
            actions = self._warm_pool.adjust(self._pool.snapshot(), now, deployments, actions)
        for action in actions:
            if isinstance(action, Pause):
                self._pool.transition(action.instance_id, InstanceState.PAUSED, now)
                self._spawn(self._instances.pause(action.instance_id))
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
        self._pool.forget_stopped()
        self._publish_gauges()

    def _autoscale(self, now: float) -> dict[str, int]:
        desired = {}
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
            # Pre-start for the autoscaler only under load: idle capacity is the lifecycle's call.
            desired[deployment.key] = decision.desired if concurrency > 0 else 0
            self._metrics.set_load(deployment.key, concurrency, deployment.waiting, desired[deployment.key],
                                   decision.panic)
        return desired

    def _plans(self, deployments: dict[str, Deployment]) -> dict[str, IdlePlan] | None:
        policy = self._keepalive
        if policy is None:
            return None
        plans = {}
        for key, deployment in deployments.items():
            if deployment.plan is None:
                if deployment.history is None:
                    deployment.history = policy.new_history()
                deployment.plan = policy.plan(deployment.history)
            plans[key] = deployment.plan
        return plans

    async def _prestart(self, deployment: Deployment, placeholder: str, rung: Rung, slice_id: str) -> None:
        try:
            await self._instances.launch(placeholder, deployment.key, rung, slice_id, serve=False)
        except EmberError as err:
            # Exponential backoff (1 s doubling to 60 s), so a model whose origin is down or whose
            # code cannot load is not started (and fetched) again on every tick.
            deployment.retry_delay_s = min(60.0, max(1.0, 2 * deployment.retry_delay_s))
            deployment.retry_at = self._clock.now() + deployment.retry_delay_s
            log.error("pre-start of %s failed (next try in %.0fs): %s", deployment.key,
                      deployment.retry_delay_s, err.message)
            return
        deployment.retry_at, deployment.retry_delay_s = 0.0, 0.0

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
