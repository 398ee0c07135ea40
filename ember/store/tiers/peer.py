"""The peer tier: fetch a missing chunk from another node's gateway before going to the origin.

Order of a read: memory -> disk -> peers -> origin. Which nodes hold a chunk is a `PeerDirectory`'s answer
(the cluster controller knows; `StaticPeers` asks a fixed list, `--store-peers`). Each peer is read like the
HTTP origin (`HttpTier`, the same parallel Range requests and hashing), from its gateway's read-only
`GET /v2/store/chunks/{digest}` route with the cluster token. The store checks every answer's digest, as
for every tier: a corrupt answer is rejected (counted) and the next holder tried, then the origin.

Across the cluster one node at a time pulls a given chunk from the origin: a `FetchGate` grants that node a
lease; the others wait for it to be released and then fetch the chunk from the node that landed it.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from ember.store.manifest import Chunk
from ember.store.tiers import Source
from ember.store.tiers.http import HttpTier

# A peer's chunk route under its gateway's base URL (ember/gateway/store_api.py serves it).
CHUNK_ROUTE = "v2/store/chunks/"


def peer_chunk_path(chunk: Chunk) -> str:
    return CHUNK_ROUTE + chunk.digest


class PeerDirectory(Protocol):
    """Which other nodes hold a chunk."""

    def holders(self, digest: str) -> list[str]:
        """Base URLs of gateways (`http://host:port/`) that may hold the chunk, best first; never this node's
        own. A holder may be wrong (evicted since, gone): the store tries the next one, then the origin."""
        ...


@dataclass(frozen=True)
class Lease:
    """The right to pull one chunk from the origin, granted to this node by a `FetchGate`."""

    digest: str
    token: str = ""   # the gate's own handle (e.g. a lease id in the controller); opaque to the store


class FetchGate(Protocol):
    """Single flight across the cluster: one node at a time pulls a given chunk from the origin.

    Contract (what the store relies on; the cluster controller implements it over Ray, `LocalGate` on one
    node, `ember.testing.peers.FakeCluster` in tests):

    * `acquire(digest)` never blocks. It returns a `Lease` when no other node holds one for `digest`: this
      node pulls the chunk from the origin, then calls `release(lease, landed)` exactly once, whatever
      happened. It returns None while another node holds the lease.
    * `wait(digest, timeout_s)` blocks until the lease on `digest` is released (or `timeout_s` passes, or at
      once when no lease is held); the store then asks its `PeerDirectory` again, and so finds the node that
      just landed the chunk, or acquires the lease itself when that node failed.
    * `release(lease, landed=True)` means the chunk is now in that node's local tiers and may be served to
      peers: the directory lists the node as a holder from then on (before waiters wake). `landed=False`
      (the origin fetch failed) lets the next `acquire` grant it to another node.
    * A lease whose holder died must not block the others forever: the cluster implementation expires it
      (its node left the cluster, or a lease timeout). The store also bounds its waiting: after
      `StoreConfig.peer_wait_s` it pulls from the origin itself.
    """

    def acquire(self, digest: str) -> Lease | None: ...

    def wait(self, digest: str, timeout_s: float) -> None: ...

    def release(self, lease: Lease, landed: bool) -> None: ...


class StaticPeers:
    """A fixed list of peer gateways (`--store-peers URL,...`), each asked in turn for every chunk."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = [u.rstrip("/") + "/" for u in urls]

    def holders(self, digest: str) -> list[str]:
        return list(self.urls)


class LocalGate:
    """One node on its own: always granted (within the node, a lock file per chunk already single-flights)."""

    def acquire(self, digest: str) -> Lease | None:
        return Lease(digest)

    def wait(self, digest: str, timeout_s: float) -> None:
        return None

    def release(self, lease: Lease, landed: bool) -> None:
        return None


@dataclass(frozen=True)
class PeerCounts:
    rejected: int   # answers whose bytes failed the digest check
    failed: int     # peers that did not have the chunk, or could not be reached


class PeerTier:
    """The peers as a list of `Source`s per chunk, one HTTP reader per peer (kept for its connections)."""

    name = "peer"

    def __init__(self, directory: PeerDirectory, *, token: str | None = None, timeout_s: float = 10.0,
                 part_size: int = 64 << 20, threads: int = 4,
                 connect: Callable[[str], Source] | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.directory = directory
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._connect = connect or (lambda url: HttpTier(
            url, timeout_s=timeout_s, part_size=part_size, threads=threads, name="peer", headers=headers,
            path_of=peer_chunk_path, ssl_context=tls))
        self._peers: dict[str, Source] = {}
        self._lock = threading.Lock()
        self._rejected = self._failed = 0

    def sources(self, digest: str) -> Iterator[tuple[str, Source]]:
        """(url, reader) of each holder the directory names, in its order."""
        for url in self.directory.holders(digest):
            with self._lock:
                source = self._peers.get(url)
                if source is None:
                    source = self._peers[url] = self._connect(url)
            yield url, source

    def note_rejected(self) -> None:
        with self._lock:
            self._rejected += 1

    def note_failed(self) -> None:
        with self._lock:
            self._failed += 1

    def counts(self) -> PeerCounts:
        with self._lock:
            return PeerCounts(self._rejected, self._failed)

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            closer = getattr(peer, "close", None)
            if closer is not None:
                closer()
