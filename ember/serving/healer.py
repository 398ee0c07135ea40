"""Self-healing: a model whose template died is served from the zygote meanwhile, and its template is made again.

A template (or the zygote it was forked from, which takes its templates with it) can die: killed, OOM, a bug.
Without this, every later start asked the node for a template that was gone and failed with 503 while the
model's readiness said 200. On each tick, for every ready model that keeps a template: if the node has none,
the pool's info stops naming the template rung (starts go to the zygote, which the node respawns on demand)
and `node.prepare` runs again in the background, with backoff (1 s doubling to 60 s) while it fails. The
model stays READY while it can serve; `reason` says that it runs degraded. A template its keep-alive plan
released on purpose (`Deployment.released`) is not lost: the healer leaves it to the plan.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ember.core.clock import Clock
from ember.core.pool import Pool
from ember.errors import EmberError
from ember.node.api import Node
from ember.serving.deployments import Deployment, Deployments
from ember.serving.instances import Spawn

log = logging.getLogger("ember.controller")

MAX_BACKOFF_S = 60.0


class Healer:
    def __init__(self, pool: Pool, node: Node, deployments: Deployments, clock: Clock, spawn: Spawn) -> None:
        self._pool, self._node, self._deployments = pool, node, deployments
        self._clock, self._spawn = clock, spawn
        self._repairing: set[str] = set()

    def tick(self) -> None:
        now = self._clock.now()
        for deployment in self._deployments.ready():
            key = deployment.key
            info = self._pool.models.get(key)
            if info is None or not deployment.contract.scaling.keep_template or key in self._repairing:
                continue
            if deployment.released:
                continue   # its keep-alive plan released the template: not lost, and made again when planned
            if self._node.has_template(key):
                continue
            if info.has_template:
                self._pool.models[key] = replace(info, has_template=False)
                deployment.reason = "its template exited: instances start from the zygote while it is made again"
                log.warning("%s: template lost; starting from the zygote and making a new template", key)
            if now >= deployment.heal_at:
                self._repairing.add(key)
                self._spawn(self._repair(deployment))

    async def _repair(self, deployment: Deployment) -> None:
        key = deployment.key
        try:
            await self._node.prepare(deployment.contract)
        except EmberError as err:
            deployment.heal_delay_s = min(MAX_BACKOFF_S, max(1.0, 2 * deployment.heal_delay_s))
            deployment.heal_at = self._clock.now() + deployment.heal_delay_s
            deployment.reason = f"its template exited and cannot be made again (next try in " \
                                f"{deployment.heal_delay_s:.0f} s): {err.message}"
            log.error("%s: %s", key, deployment.reason)
            return
        finally:
            self._repairing.discard(key)
        info = self._pool.models.get(key)
        if info is not None and self._node.has_template(key):
            self._pool.models[key] = replace(info, has_template=True)
            deployment.reason, deployment.heal_at, deployment.heal_delay_s = "", 0.0, 0.0
            log.info("%s: template made again", key)
