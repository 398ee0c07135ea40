"""A node's inventory for the cluster controller, read from its serving controller and node (no Ray)."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from ember.core.scheduler import startable_slices
from ember.core.states import InstanceState
from ember.errors import EmberError
from ember.node.api import Node
from ember.serving.controller import Controller
from ember.wire.cluster import Held, NodeInventory, Warm
from ember.wire.contract import ModelContract


def weights_bytes(contract: ModelContract) -> int:
    """The size of a model's weight files (not in a store) where this node can tell (0: unknown)."""
    try:
        path = contract.weights_path()
    except EmberError:
        return 0
    if path is None or not path.exists():
        return 0
    return _size_of(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _size_of(path: Path, _stamp: int) -> int:
    """Walked once per path and stamp, not on every report (a node reports twice a second)."""
    files: Iterable[Path] = [path] if path.is_file() else (p for p in path.rglob("*") if p.is_file())
    return sum(p.stat().st_size for p in files)


def _sizes(node: Node, contract: ModelContract) -> tuple[int, int]:
    """(bytes, local bytes): a store-backed model's from its manifest here (0: this node has not seen it; a node
    that has reports it, and placement takes the largest report), else its weight files'."""
    store = node.weights_size(contract)
    if store is not None:
        return store
    size = weights_bytes(contract)
    return size, size if node.weights_local(contract) else 0


def inventory(controller: Controller, node_id: str, url: str, known: Iterable[ModelContract], *,
              given: Iterable[ModelContract], disk_bps: float, net_bps: float, service_s: float) -> NodeInventory:
    """What `node_id` holds now. `known`: every model of the cluster's registry (what the node holds of each:
    its template, paused (or asleep) instances, local weights); `given`: the contracts of its own --models. `disk_bps`,
    `net_bps`: the figures assumed until the node's store has measured its own; `service_s`, per waiting request
    of a model whose rate it has not measured (the cluster's figure)."""
    snapshot = controller.snapshot()
    node = controller.node
    measured = node.bandwidths()
    which: list[Literal["disk", "net"]] = []
    if measured.disk_bps is not None:
        which.append("disk")
    if measured.peer_bps is not None:
        which.append("net")
    free = startable_slices(snapshot)   # an idle instance of another model gives way to a start, as on one node
    # An asleep instance that can wake counts with the paused: the node serves it without a new process (priced as a
    # resume: the cluster's rung costs have no wake yet).
    paused = Counter(i.model for i in snapshot.instances if i.state is InstanceState.PAUSED
                     or (i.state is InstanceState.ASLEEP and snapshot.can_wake(i)))
    held = []
    for contract in {c.key: c for c in (*known, *given)}.values():
        size, local = _sizes(node, contract)
        held.append(Held(model=contract.key, paused=paused[contract.key], template=node.has_template(contract.key),
                         bytes=size, local_bytes=local))
    warm = [Warm(id=i.id, model=i.model, in_flight=i.inflight,
                 max_concurrency=snapshot.models[i.model].per_instance)
            for i in snapshot.instances if i.state.ready and i.model in snapshot.models]
    return NodeInventory(
        node=node_id, url=url, memory_mb=sum(s.memory_mb for s in snapshot.slices),
        free_memory_mb=sum(s.memory_mb for s in free),
        slices=dict(Counter(s.kind for s in snapshot.slices)), free_slices=dict(Counter(s.kind for s in free)),
        queue=controller.waiting(), queue_s=controller.queue_s(service_s), disk_bps=measured.disk_bps or disk_bps,
        net_bps=measured.peer_bps or net_bps,
        measured=tuple(which), origin_bps=measured.origin_bps, held=tuple(held), warm=tuple(warm),
        contracts=tuple(given), serving=tuple(snapshot.models), jobs=controller.queued_jobs())
