"""Fakes and fixtures for the weight store's peer tier.

- `FakeCluster`: an in-process `PeerDirectory` and `FetchGate` shared by several nodes (`cluster.node(url)`),
  following the gate's contract (ember/store/tiers/peer.py); it counts the origin leases it granted.
- `MemorySource`: a peer or origin whose chunks are bytes in a dict; it counts reads and can corrupt them.
- `StateChunks`: the cluster controller's chunk calls straight onto a `ClusterState` (no Ray), able to fail.
- `ChunkServer`: ember's real gateway app (a `FakeService`, the store's `SharedChunks`) on a loopback port in a
  thread, so that stores in one test process fetch from each other over HTTP.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Sequence

from ember.cluster.state import ClusterState
from ember.core.clock import Clock
from ember.errors import NodeUnreachable, StoreError
from ember.gateway.app import create_app
from ember.gateway.auth import Auth, KeyLookup
from ember.metrics import Metrics
from ember.store.config import StoreConfig
from ember.store.manifest import Chunk
from ember.store.shared import SharedChunks
from ember.store.tiers.peer import Lease
from ember.testing.asgi import ThreadedServer
from ember.testing.service import FakeService


class FakeCluster:
    """What the cluster controller knows about chunks: who holds each, and who holds each origin lease."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._leases: dict[str, str] = {}       # digest -> url of the node pulling it from the origin
        self._holders: dict[str, list[str]] = {}
        self.grants: Counter[str] = Counter()   # origin leases granted, per digest

    def node(self, url: str) -> FakeClusterNode:
        return FakeClusterNode(self, url.rstrip("/") + "/")

    def add_holder(self, url: str, digests: Sequence[str]) -> None:
        with self._cond:
            for digest in digests:
                held = self._holders.setdefault(digest, [])
                if url not in held:
                    held.append(url)
            self._cond.notify_all()


class FakeClusterNode:
    """One node's view of a `FakeCluster`: implements `PeerDirectory` and `FetchGate`."""

    def __init__(self, cluster: FakeCluster, url: str) -> None:
        self.cluster, self.url = cluster, url

    def holders(self, digest: str) -> list[str]:
        with self.cluster._cond:
            return [u for u in self.cluster._holders.get(digest, []) if u != self.url]

    def acquire(self, digest: str) -> Lease | None:
        c = self.cluster
        with c._cond:
            if digest in c._leases:
                return None
            c._leases[digest] = self.url
            c.grants[digest] += 1
            return Lease(digest, self.url)

    def wait(self, digest: str, timeout_s: float) -> None:
        with self.cluster._cond:
            self.cluster._cond.wait_for(lambda: digest not in self.cluster._leases, timeout_s)

    def release(self, lease: Lease, landed: bool) -> None:
        c = self.cluster
        with c._cond:
            if landed:   # a holder before the waiters wake (the contract)
                held = c._holders.setdefault(lease.digest, [])
                if self.url not in held:
                    held.append(self.url)
            c._leases.pop(lease.digest, None)
            c._cond.notify_all()


class MemorySource:
    """A peer (or origin) holding chunks as bytes; `corrupt` answers with one byte flipped."""

    def __init__(self, chunks: dict[str, bytes] | None = None, *, name: str = "fake", corrupt: bool = False) -> None:
        self.chunks = dict(chunks or {})
        self.name = name
        self.corrupt = corrupt
        self.reads: Counter[str] = Counter()

    def copy_to(self, chunk: Chunk, fds: Sequence[int]) -> str | None:
        self.reads[chunk.digest] += 1
        data = self.chunks.get(chunk.digest)
        if data is None:
            raise StoreError(f"{self.name} has no chunk {chunk.digest}")
        if self.corrupt and data:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        for fd in fds:
            os.pwrite(fd, data, 0)
        return None

    def fetch(self, path: str) -> bytes | None:
        return None


class ChunkServer(ThreadedServer):
    """A real ember gateway serving a store's chunks on 127.0.0.1 (no node, no models)."""

    def __init__(self, config: StoreConfig, *, cluster_token: str | None = None, keys: KeyLookup | None = None,
                 port: int = 0) -> None:
        auth = Auth(keys, cluster_token=cluster_token)
        super().__init__(create_app(FakeService(), Metrics(), auth=auth, chunks=SharedChunks(config)), port=port,
                         name="chunk-server")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"


class StateChunks:
    """`ember.cluster.peers.ChunkCalls` straight onto a `ClusterState` (what the controller actor does over Ray);
    `down` makes every call fail as a controller away would. Counts the calls."""

    def __init__(self, state: ClusterState, clock: Clock) -> None:
        self.state, self.clock = state, clock
        self.down = False
        self.calls = 0

    def _call(self) -> None:
        self.calls += 1
        if self.down:
            raise NodeUnreachable("the cluster controller: away (a test)")

    def holders(self, digest: str, models: tuple[str, ...], node: str) -> list[str]:
        self._call()
        return self.state.chunk_holders(digest, models, node)

    def model_holders(self, models: tuple[str, ...], node: str) -> list[str]:
        self._call()
        return self.state.model_holders(models, node)

    def acquire(self, digest: str, node: str) -> str | None:
        self._call()
        return self.state.chunks.acquire(digest, node, self.clock.now())

    def leased(self, digest: str) -> bool:
        self._call()
        return self.state.chunks.leased(digest, self.clock.now())

    def release(self, digest: str, lease: str, node: str, landed: bool) -> None:
        self._call()
        self.state.chunks.release(digest, lease, node, landed)
