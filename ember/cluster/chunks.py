"""The controller's record of weight-store chunks across nodes, without Ray: origin leases and who landed what.

The cluster side of the store's `FetchGate` contract (ember/store/tiers/peer.py): one node at a time holds the
lease to pull a chunk from the origin; its `release(landed=True)` makes it a holder of that chunk (recorded
before the lease goes, so a waiter that sees the lease gone finds the holder). A lease ends when released,
when its node leaves the cluster (`forget`), or after `lease_ttl_s` (a holder that hung must not block the
others for ever). Nothing here is persisted: a restarted controller has no leases (waiters then acquire one
themselves) and learns holders again from the nodes' inventories.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class _Lease:
    id: str
    node: str
    since: float


class ChunkBook:
    def __init__(self, lease_ttl_s: float = 300.0) -> None:
        self._ttl_s = lease_ttl_s
        self._leases: dict[str, _Lease] = {}          # digest -> the lease on it
        self._landed: dict[str, set[str]] = {}        # digest -> nodes that landed it under a lease
        self._ids = itertools.count(1)
        self.granted = 0

    def _live(self, digest: str, now: float) -> _Lease | None:
        lease = self._leases.get(digest)
        if lease is not None and now - lease.since > self._ttl_s:
            del self._leases[digest]
            return None
        return lease

    def acquire(self, digest: str, node: str, now: float) -> str | None:
        """A lease id when no other node holds a live lease on `digest`; None while one does. A node asking
        again for a lease it holds gets it again (a retry after a lost answer)."""
        lease = self._live(digest, now)
        if lease is not None:
            return lease.id if lease.node == node else None
        lease = _Lease(f"{node}/{next(self._ids)}", node, now)
        self._leases[digest] = lease
        self.granted += 1
        return lease.id

    def leased(self, digest: str, now: float) -> bool:
        return self._live(digest, now) is not None

    def release(self, digest: str, lease_id: str, node: str, landed: bool) -> None:
        """The holder's end of the lease; `landed`: `node` now holds the chunk. An unknown or expired lease
        still records the landing (the chunk is there whatever became of the lease)."""
        if landed:
            self._landed.setdefault(digest, set()).add(node)
        lease = self._leases.get(digest)
        if lease is not None and lease.id == lease_id:
            del self._leases[digest]

    def landed(self, digest: str) -> set[str]:
        return set(self._landed.get(digest, ()))

    def forget(self, node: str) -> None:
        """A node left the cluster: its leases end and it holds nothing any more."""
        for digest in [d for d, lease in self._leases.items() if lease.node == node]:
            del self._leases[digest]
        for nodes in self._landed.values():
            nodes.discard(node)
