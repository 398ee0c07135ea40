"""The Ray-facing code of a cluster, and the only module that imports Ray.

    ControllerActor   detached, named "ember-controller" in namespace "ember", on the head (num_cpus=0,
                      max_restarts=-1): the model registry, the live nodes' inventories, placement
                      (`ClusterState`). Its state is rebuilt from the nodes' reports after a restart.
                      A node leaves its view when Ray's GCS marks the node dead (polled every
                      `GCS_POLL_S`; gateways hear of it at once, `gone`) or when it has not reported
                      for `ttl_s`, whichever comes first.
    NodeAgent         one per machine, pinned to it (NodeAffinitySchedulingStrategy): it owns that
                      machine's `ember serve` (gateway and node: zygotes, templates, instances, weight
                      store) as a subprocess, fork+exec, never os.fork() in a Ray worker. The serve
                      process watches it and dies with it (the machine is gone).
    RayLink           in an `ember serve --ray ADDRESS` process, a Ray driver: reports to the
                      controller and asks it to place (`ClusterLink`). The zygote never imports Ray.
    RayScaler         the controller's `NodeScaler`: asks Ray's autoscaler for machines when every node is
                      full (`ray.autoscaler.sdk.request_resources`; KubeRay's worker group scales up from zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ember.clock import SystemClock
from ember.cluster.state import ClusterState, Holder, ScaleSettings
from ember.core.placement import Placed, Placement
from ember.errors import NodeUnreachable
from ember.wire.cluster import ClusterView, NodeInventory

NAMESPACE = "ember"
CONTROLLER = "ember-controller"
PARENT_ENV = "EMBER_AGENT_PID"     # set for a serve process an agent started: it dies with the agent

log = logging.getLogger("ember.cluster")


def connect(address: str) -> str:
    """Join the Ray cluster at `address` ("auto": the one on this machine) as a driver; this process's node id."""
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False,
                 include_dashboard=False)
    return str(ray.get_runtime_context().get_node_id())


NODE_BUNDLE = {"CPU": 1.0}   # what one node offers Ray (deploy/kuberay: a worker pod's raylet, num-cpus 1)


class RayScaler:
    """`NodeScaler` over Ray's autoscaler. `request_resources` is declarative and counts every node the cluster
    has: a cluster of `nodes` machines is asked for as that many one-node bundles (a CPU-less head fits none)."""

    def __init__(self, bundle: dict[str, float]) -> None:
        self._bundle = dict(bundle)

    def request_nodes(self, nodes: int) -> None:
        from ray.autoscaler.sdk import request_resources  # Ray's own module, only where it is asked

        request_resources(bundles=[dict(self._bundle) for _ in range(nodes)])


GCS_POLL_S = 0.1   # how often the controller reads Ray's node table (one GCS call)
GONE_WAIT_S = 30.0  # a gateway's long poll for the next node Ray's GCS declares dead (`ControllerActor.gone`)


def dead_nodes() -> frozenset[str]:
    """The nodes Ray's GCS has marked dead (its health checks failed: `RAY_health_check_*`, docs/cluster.md)."""
    return frozenset(str(n["NodeID"]) for n in ray.nodes() if not n.get("Alive", False))


class Deaths:
    """The nodes Ray's GCS declared dead, in the order the controller read them, and the gateways waiting to hear
    of the next (a long poll: `since`). `add` is the GCS watcher thread's; `since` runs on the actor's event loop,
    and so does `on_death` (the controller's state is only touched there)."""

    def __init__(self, on_death: Callable[[], None]) -> None:
        self.nodes: list[str] = []
        self._on_death = on_death
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def add(self, dead: frozenset[str]) -> None:
        new = sorted(dead - set(self.nodes))
        if not new:
            return
        self.nodes.extend(new)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._on_death()
        if self._event is not None:
            self._event.set()
            self._event = None

    async def since(self, seen: int, wait_s: float) -> tuple[int, tuple[str, ...]]:
        """(how many so far, those after the first `seen`), waiting up to `wait_s` for one when there is none
        yet; `seen` < 0 (a gateway's first call): the count alone, at once. A count above ours (the controller
        restarted): every one."""
        self._loop = asyncio.get_running_loop()
        if 0 <= seen == len(self.nodes):
            if self._event is None:
                self._event = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), wait_s)
        count = len(self.nodes)
        first = count if seen < 0 else seen if seen <= count else 0
        return count, tuple(self.nodes[first:count])


class ControllerActor:
    def __init__(self, token: str, ttl_s: float, origin_bps: float, service_s: float,
                 node_bundle: dict[str, float] | None = None, scale: ScaleSettings | None = None) -> None:
        # The token comes from the creator, so a restarted controller hands out the same one.
        self._clock = SystemClock()
        self._state = ClusterState(self._clock, ttl_s=ttl_s, origin_bps=origin_bps, service_s=service_s,
                                   token=token, scaler=RayScaler(node_bundle or NODE_BUNDLE),
                                   scale=scale or ScaleSettings())
        self._dead: frozenset[str] = frozenset()   # Ray's GCS's dead nodes, as last read (by the watcher thread)
        self._deaths = Deaths(self._forget_dead)
        threading.Thread(target=self._watch_gcs, name="ember-gcs-nodes", daemon=True).start()

    def _watch_gcs(self) -> None:
        while True:
            try:
                self._dead = dead_nodes()
                self._deaths.add(self._dead)
            except Exception as err:   # the GCS away for a moment: the report timeout still applies
                log.warning("cluster: reading Ray's node table failed (%s: %s)", type(err).__name__, err)
            time.sleep(GCS_POLL_S)

    async def gone(self, seen: int, wait_s: float = GONE_WAIT_S) -> tuple[int, tuple[str, ...]]:
        """A gateway's long poll: the nodes Ray's GCS declared dead after the first `seen` (`Deaths.since`), as
        soon as the controller reads them (the gateway drops them then, not at its next report). The one
        coroutine method: it makes this an asyncio actor, whose other methods run one at a time on its loop."""
        return await self._deaths.since(seen, wait_s)

    def _forget_dead(self) -> None:
        for node in self._dead & self._state.nodes().keys():
            self._state.remove(node, "dead in Ray's GCS")

    def report(self, inventory: NodeInventory) -> ClusterView:
        self._forget_dead()
        if inventory.node in self._dead:   # a node Ray has declared dead does not come back on its own report
            return self._state.view()
        return self._state.report(inventory)

    def place(self, model: str, avoid: tuple[str, ...] = (), here: str | None = None) -> Placement:
        self._forget_dead()
        return self._state.place(model, avoid, here)

    def departed(self) -> list[tuple[str, str, float]]:
        """The last nodes that left the view: (node id, why, when: this host's monotonic clock)."""
        self._forget_dead()
        self._state.expire()
        return [(d.node, d.cause, d.at) for d in self._state.departed]

    def remove(self, node: str) -> bool:
        return self._state.remove(node)

    def placed(self, node: str) -> None:
        """A start a gateway placed on its own view: queued on that node until it reports again."""
        self._state.note_start(node)

    def view(self) -> ClusterView:
        self._forget_dead()
        return self._state.view()

    def scale_request(self) -> tuple[int, tuple[str, ...]]:
        """The last request made of Ray's autoscaler: the cluster size (0: none) and the models waiting for room."""
        return self._state.asked.nodes, self._state.asked.models

    def token(self) -> str:
        """The cluster's one token (peer chunk routes and forwarded requests alike)."""
        return self._state.token

    def holders(self, model: str) -> list[Holder]:
        """Which nodes hold every chunk of `model`, and their URLs."""
        return self._state.holders(model)

    # The weight store's peer tier (ember/cluster/peers.py, `RayChunks` below): directory and fetch gate.
    def chunk_holders(self, digest: str, store_models: tuple[str, ...], node: str) -> list[str]:
        return self._state.chunk_holders(digest, store_models, node)

    def model_holders(self, store_models: tuple[str, ...], node: str) -> list[str]:
        return self._state.model_holders(store_models, node)

    def acquire_chunk(self, digest: str, node: str) -> str | None:
        return self._state.chunks.acquire(digest, node, self._clock.now())

    def chunk_leased(self, digest: str) -> bool:
        return self._state.chunks.leased(digest, self._clock.now())

    def release_chunk(self, digest: str, lease: str, node: str, landed: bool) -> None:
        self._state.chunks.release(digest, lease, node, landed)


def controller(*, token: str | None = None, ttl_s: float = 3.0, origin_bps: float = 1e8,
               service_s: float = 0.05, node_bundle: dict[str, float] | None = None,
               scale: ScaleSettings | None = None) -> Any:
    """The cluster's controller actor, created on the head by the first node that asks. Its creator's `token`
    (else a random one) becomes the cluster's; for an existing controller every argument is ignored.
    `node_bundle` is what one node offers Ray (the autoscaler is asked for nodes as bundles of it)."""
    return ray.remote(ControllerActor).options(
        name=CONTROLLER, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
        max_restarts=-1, max_task_retries=-1, resources={"node:__internal_head__": 0.001},
    ).remote(token or secrets.token_urlsafe(24), ttl_s, origin_bps, service_s, node_bundle, scale)


class NodeAgent:
    """One machine's `ember serve`, started as a subprocess of this actor (fork+exec)."""

    def __init__(self, address: str, port: int, state_dir: str, args: list[str], env: dict[str, str]) -> None:
        self.node_id = str(ray.get_runtime_context().get_node_id())
        self.port = port
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        self.log_path = Path(state_dir) / "serve.log"
        cmd = [sys.executable, "-m", "ember", "serve", "--ray", address, "--ray-node-id", self.node_id,
               "--port", str(port), "--state-dir", state_dir, *args]
        full_env = {**os.environ, **env, PARENT_ENV: str(os.getpid())}
        with self.log_path.open("ab") as out:
            self._proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                          start_new_session=True)
        # It inherits this worker's niceness (Ray's 15) and sets itself back to 0 (join.normal_priority).

    def info(self) -> dict[str, Any]:
        return {"node": self.node_id, "pid": self._proc.pid, "port": self.port, "log": str(self.log_path),
                "alive": self._proc.poll() is None}

    def stop(self) -> int | None:
        self._proc.terminate()
        try:
            return self._proc.wait(15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return self._proc.wait()


def start_agent(node_id: str, address: str, port: int, state_dir: str, args: list[str],
                env: dict[str, str] | None = None) -> Any:
    """A node agent pinned to `node_id`."""
    return ray.remote(NodeAgent).options(
        name=f"ember-agent-{node_id}", namespace=NAMESPACE, num_cpus=0, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(address, port, state_dir, args, env or {})


class RayChunks:
    """`ChunkCalls` over Ray, synchronous (the store's fetch threads): each call waits at most `timeout_s`; Ray's
    errors (the controller restarting, gone, slow) become NodeUnreachable, and the caller falls back."""

    def __init__(self, handle: Any, timeout_s: float = 2.0) -> None:
        self._controller, self._timeout_s = handle, timeout_s

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self._controller, method).remote(*args), timeout=self._timeout_s)
        except Exception as err:   # GetTimeoutError, RayActorError, ...: all mean "not now"
            raise NodeUnreachable(f"the cluster controller ({method}): {type(err).__name__}: {err}") from None

    def holders(self, digest: str, models: tuple[str, ...], node: str) -> list[str]:
        found: list[str] = self._call("chunk_holders", digest, models, node)
        return found

    def model_holders(self, models: tuple[str, ...], node: str) -> list[str]:
        found: list[str] = self._call("model_holders", models, node)
        return found

    def acquire(self, digest: str, node: str) -> str | None:
        lease: str | None = self._call("acquire_chunk", digest, node)
        return lease

    def leased(self, digest: str) -> bool:
        return bool(self._call("chunk_leased", digest))

    def release(self, digest: str, lease: str, node: str, landed: bool) -> None:
        self._call("release_chunk", digest, lease, node, landed)


class RayLink:
    """`ClusterLink` over Ray: the controller actor's methods, awaited on the gateway's event loop."""

    def __init__(self, handle: Any) -> None:
        self._controller = handle

    async def report(self, inventory: NodeInventory) -> ClusterView:
        view: ClusterView = await self._controller.report.remote(inventory)
        return view

    async def place(self, model: str, avoid: tuple[str, ...], here: str | None = None) -> Placement:
        placement: Placement = await self._controller.place.remote(model, avoid, here)
        return placement

    async def gone(self, seen: int) -> tuple[int, tuple[str, ...]]:
        count, nodes = await self._controller.gone.remote(seen)
        return int(count), tuple(nodes)

    def placed(self, placement: Placed) -> None:
        self._controller.placed.remote(placement.node)   # submitted, not awaited
