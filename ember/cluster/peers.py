"""The weight store's peer directory and fetch gate on a node of a Ray cluster, over the controller (no Ray here).

The node's store calls these from its fetch threads, synchronously (ember/store/tiers/peer.py: `PeerDirectory`,
`FetchGate`); each is one controller call with a timeout (`ChunkCalls`, Ray behind it in
ember/cluster/actors.py). The controller away (restarting, unreachable, slow) never stalls a fetch: the
directory answers the static peers (`--store-peers`) alone and the gate grants every lease (as `LocalGate`
does on one node), and for `retry_s` after a failure the controller is not asked at all.

Which peers hold a chunk: the controller answers from the leases it granted (a node that landed the chunk)
and the nodes' inventories (a node holding every chunk of a model the chunk belongs to). This node tells it
which models those are: the manifests in its store root that list the chunk (`ManifestIndex`). The nodes
holding a whole model are asked once per `cache_s` for all of its chunks (a pull of a model some node holds
costs one controller call, not one per chunk); a chunk of a model no node holds whole is asked for itself.
Each chunk's holders come in an order of their own (`spread`), so a pull spreads over every node holding it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from ember.clock import SystemClock
from ember.core.clock import Clock
from ember.errors import EmberError
from ember.store.manifest import Manifest
from ember.store.tiers.peer import Lease

log = logging.getLogger("ember.cluster")

LOCAL = "local"   # a lease this node granted itself while the controller was away (nothing to release)


class ChunkCalls(Protocol):
    """The controller's chunk methods, called synchronously with a timeout; any failure raises an EmberError."""

    def holders(self, digest: str, models: tuple[str, ...], node: str) -> list[str]:
        """Gateway URLs of the live nodes but `node` that hold the chunk."""
        ...

    def model_holders(self, models: tuple[str, ...], node: str) -> list[str]:
        """Gateway URLs of the live nodes but `node` holding every chunk of one of `models`."""
        ...

    def acquire(self, digest: str, node: str) -> str | None: ...

    def leased(self, digest: str) -> bool: ...

    def release(self, digest: str, lease: str, node: str, landed: bool) -> None: ...


class ManifestIndex:
    """Chunk digest -> the store models (`name:version`) whose manifests in the store root list it."""

    def __init__(self, root: Path) -> None:
        self._dir = root / "manifests"
        self._index: dict[str, tuple[str, ...]] = {}
        self._lock = threading.Lock()

    def models_of(self, digest: str) -> tuple[str, ...]:
        with self._lock:
            if digest not in self._index:   # a manifest written since (the model being pulled): read them again
                self._index = self._read()
            return self._index.get(digest, ())

    def _read(self) -> dict[str, tuple[str, ...]]:
        index: dict[str, set[str]] = {}
        for path in self._dir.glob("*/*.json"):
            try:
                manifest = Manifest.from_json(path.read_bytes(), str(path))
            except (OSError, EmberError):   # being written, or not ours: the next miss reads it again
                continue
            for digest in manifest.unique_chunks():
                index.setdefault(digest, set()).add(manifest.key)
        return {d: tuple(sorted(m)) for d, m in index.items()}


def spread(digest: str, holders: list[str]) -> list[str]:
    """The holders, each chunk's list starting at a different one (by its digest): a model's chunks are fetched
    from all of its holders at once, not all from the first."""
    if len(holders) < 2:
        return holders
    k = int(digest[:8], 16) % len(holders)
    return holders[k:] + holders[:k]


class ClusterChunks:
    """`PeerDirectory` and `FetchGate` of one node over the controller; static peers, local leases when it is away."""

    def __init__(self, node: str, calls: ChunkCalls, index: ManifestIndex, static: Sequence[str] = (), *,
                 clock: Clock | None = None, sleep: Callable[[float], None] = time.sleep, poll_s: float = 0.05,
                 retry_s: float = 5.0, cache_s: float = 1.0) -> None:
        self._node, self._calls, self._index = node, calls, index
        self._static = [u.rstrip("/") + "/" for u in static]
        self._clock: Clock = clock or SystemClock()
        self._sleep, self._poll_s, self._retry_s = sleep, poll_s, retry_s
        self._away_until = float("-inf")
        self._cache_s = cache_s
        self._whole: dict[tuple[str, ...], tuple[float, list[str]]] = {}   # models -> (when, holders of one whole)
        self._lock = threading.Lock()

    def _up(self) -> bool:
        with self._lock:
            return self._clock.now() >= self._away_until

    def _away(self, err: EmberError) -> None:
        with self._lock:
            first = self._clock.now() >= self._away_until
            self._away_until = self._clock.now() + self._retry_s
        if first:
            log.warning("weight store: the cluster controller did not answer (%s); static peers and local leases "
                        "for %g s", err.message, self._retry_s)

    # -- PeerDirectory ------------------------------------------------------------------------------
    def holders(self, digest: str) -> list[str]:
        found: list[str] = []
        if self._up():
            try:
                models = self._index.models_of(digest)
                found = spread(digest, self._whole_model(models) or self._calls.holders(digest, models, self._node))
            except EmberError as err:
                self._away(err)
        found = [u.rstrip("/") + "/" for u in found]
        return found + [u for u in self._static if u not in found]

    def _whole_model(self, models: tuple[str, ...]) -> list[str]:
        if not models:
            return []
        now = self._clock.now()
        with self._lock:
            cached = self._whole.get(models)
        if cached is not None and now - cached[0] <= self._cache_s:
            return cached[1]
        found = self._calls.model_holders(models, self._node)
        with self._lock:
            self._whole[models] = (now, found)
        return found

    # -- FetchGate ----------------------------------------------------------------------------------
    def acquire(self, digest: str) -> Lease | None:
        if self._up():
            try:
                lease = self._calls.acquire(digest, self._node)
                return None if lease is None else Lease(digest, lease)
            except EmberError as err:
                self._away(err)
        return Lease(digest, LOCAL)

    def wait(self, digest: str, timeout_s: float) -> None:
        deadline = self._clock.now() + timeout_s
        while self._up() and self._clock.now() < deadline:
            try:
                if not self._calls.leased(digest):
                    return
            except EmberError as err:
                self._away(err)
                return
            self._sleep(min(self._poll_s, max(0.0, deadline - self._clock.now())))

    def release(self, lease: Lease, landed: bool) -> None:
        if lease.token == LOCAL:
            return
        try:
            self._calls.release(lease.digest, lease.token, self._node, landed)
        except EmberError as err:   # the lease expires in the controller; the inventory lists the chunk later
            self._away(err)
