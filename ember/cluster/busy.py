"""A node with work holds Ray resources, so that Ray's autoscaler sees the machine busy (issue 32).

Why: a node's `ember serve` is a Ray driver (a KubeRay pod runs it beside its raylet), which holds no Ray
resource and no worker lease, so to Ray the machine is idle whatever it serves. Ray's autoscaler (v1
`StandardAutoscaler` and v2 alike, KubeRay's in-tree one too) removes a worker whose raylet has reported it idle
(`idle_duration_ms`: every resource available and no worker leased) for `idle_timeout_minutes` (KubeRay:
`idleTimeoutSeconds`), and would take a machine away in the middle of a job. (A node whose serve process a node
agent started is never idle: the agent actor holds a worker lease for its life.)

So while this node has work it holds its *node bundle* (`NODE_BUNDLE`, {"CPU": 1}: the unit the controller
asks the autoscaler for, one per machine, `ember/cluster/actors.py` `RayScaler`), and with no work for
`linger_s` it gives it back; Ray's idle clock starts then. The bundle is a placement group pinned to this
node's own raylet by Ray's `ray.io/node-id` label: it holds the resources without a process (an actor would
start a Ray worker, a Python process, each time the node got busy). It is not detached, so it goes with the
serve process that made it.

Work (`local_work`, read from the node's serving controller every `cluster_report_s`): requests in flight on
its instances, requests waiting for one, jobs queued in the shared store for a model it serves or was given
(it is about to claim them), and a model being deployed (a node the autoscaler has just added for a job holds
its bundle while it deploys the model, before it can claim the job). The work is sampled every
`cluster_report_s`, so a node counts as busy from its start and `linger_s` after the last work it was seen
with: a deploy and a job shorter than one sample still hold it. The controller withdraws its request for
machines only once a node *serving* the model can run it (`ClusterState._room_again`), so the new machine is
held by the request until it holds itself. A gateway only (no slices) holds nothing. A node whose raylet
offers less than the bundle (a `--num-cpus 0` raylet) never holds: the group would wait for room and Ray
would count it as demand.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ember.clock import SystemClock
from ember.core.clock import Clock
from ember.serving.controller import Controller

log = logging.getLogger("ember.cluster")


def local_work(local: Controller) -> int:
    """Requests in flight and waiting on this node, the jobs queued for its models, and the models it is
    deploying (0: idle, or a gateway only; a model that failed to deploy is no work: it would hold for ever)."""
    snapshot = local.snapshot()
    if not snapshot.slices:
        return 0
    mine = set(snapshot.models) | {c.key for c in local.offered()}
    queued = sum(n for model, n in local.queued_jobs().items() if model in mine)
    return sum(i.inflight for i in snapshot.instances) + local.waiting() + queued + local.deploying()


@dataclass(frozen=True)
class HoldPolicy:
    linger_s: float = 2.0     # keep holding this long after the last work (bursts do not churn groups)


def should_hold(work: int, now: float, last_work: float, policy: HoldPolicy) -> bool:
    """Hold while there is work, and `linger_s` after the last."""
    return work > 0 or now - last_work < policy.linger_s


class Reservation(Protocol):
    """The resources a node holds in Ray (Ray's placement group behind it: `RayReservation`)."""

    def hold(self) -> None: ...

    def release(self) -> None: ...


class RayReservation:
    """One placement group of `bundle` pinned to `node_id` (a hard label selector), made and removed on demand."""

    def __init__(self, node_id: str, bundle: dict[str, float]) -> None:
        self._node_id, self._bundle = node_id, dict(bundle)
        self._group: Any = None

    def fits(self) -> bool:
        """The node's raylet offers at least the bundle (else holding would wait forever, and ask for a node)."""
        import ray

        node = next((n for n in ray.nodes() if n["NodeID"] == self._node_id and n["Alive"]), None)
        total = node["Resources"] if node is not None else {}
        return all(total.get(k, 0.0) >= v for k, v in self._bundle.items())

    def hold(self) -> None:
        from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group

        self._group = placement_group([dict(self._bundle)], strategy="STRICT_PACK",
                                      name=f"ember-busy-{self._node_id[:12]}",
                                      bundle_label_selector=[{NODE_ID_LABEL_KEY: self._node_id}])

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None


class BusyHold:
    """Holds the node's bundle while `work()` says there is some (see the module docstring). `work` is read on
    the event loop (it reads the serving controller); Ray's calls run off it."""

    def __init__(self, reservation: Reservation, work: Callable[[], int], clock: Clock,
                 policy: HoldPolicy = HoldPolicy()) -> None:
        self._reservation, self._work, self._clock, self._policy = reservation, work, clock, policy
        self._last_work = clock.now()   # a node starting is busy: it deploys its models (work seen only by sampling)
        self.held = False
        self.changes = 0            # holds and releases made

    def wanted(self) -> bool:
        """Whether the node should hold its bundle now (reads the work)."""
        now, work = self._clock.now(), self._work()
        if work > 0:
            self._last_work = now
        return should_hold(work, now, self._last_work, self._policy)

    def apply(self, wanted: bool) -> bool:
        """Hold or release to match `wanted`; whether that changed anything."""
        if wanted == self.held:
            return False
        if wanted:
            self._reservation.hold()
        else:
            self._reservation.release()
        self.held, self.changes = wanted, self.changes + 1
        return True

    async def run(self, every_s: float) -> None:
        """Every `every_s` until cancelled; released when cancelled."""
        try:
            while True:
                wanted = self.wanted()
                try:
                    if await asyncio.to_thread(self.apply, wanted):
                        log.info("cluster: %s this node's Ray bundle (%s)", "holding" if wanted else "released",
                                 "work here" if wanted else f"no work for {self._policy.linger_s:g} s")
                except Exception as err:   # Ray's errors (the GCS restarting): the next round tries again
                    log.warning("cluster: busy hold failed (%s: %s)", type(err).__name__, err)
                await asyncio.sleep(every_s)
        finally:
            if self.held:
                self._reservation.release()
                self.held = False


def hold_while_busy(local: Controller, node_id: str, bundle: dict[str, float], every_s: float,
                    policy: HoldPolicy = HoldPolicy()) -> BusyHold | None:
    """The node's busy hold; None for a gateway only, and where its raylet could never hold `bundle` (said once
    in the log)."""
    if not local.snapshot().slices:
        return None
    reservation = RayReservation(node_id, bundle)
    if not reservation.fits():
        log.warning("cluster: this node's raylet offers less than %s: it never looks busy to Ray's autoscaler "
                    "(start the raylet with --num-cpus 1 or more)", bundle)
        return None
    return BusyHold(reservation, lambda: local_work(local), SystemClock(), policy)
