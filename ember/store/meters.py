"""The store's measured bandwidths: a `TransferRate` (ember/core/bandwidth.py) per kind of chunk transfer.

The store times every chunk it copies in, from the moment it asks the source until the copy is verified:
from a peer or the origin (a fetch: the network, the hash, the write), from its disk tier up to the memory tier
(a read of the disk tier). The store's fetch threads call these at once: a lock guards the rates. The node
reports the figures to the cluster controller, whose placement costs a start with them (docs/cluster.md).
"""

from __future__ import annotations

import threading

from ember.clock import SystemClock
from ember.core.bandwidth import Bandwidths, TransferRate
from ember.core.clock import Clock

KINDS = ("disk", "peer", "origin")   # the `Source.name`s measured: a tier's name is its kind


class TransferMeters:
    def __init__(self, clock: Clock | None = None, *, half_life_s: float = 30.0, min_bytes: int = 16 << 20) -> None:
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._rates = {kind: TransferRate(half_life_s=half_life_s, min_bytes=min_bytes) for kind in KINDS}

    def begin(self, kind: str) -> None:
        rate = self._rates.get(kind)
        if rate is not None:
            with self._lock:
                rate.begin(self._clock.now())

    def end(self, kind: str, nbytes: int) -> None:
        """The transfer `begin(kind)` started is over: `nbytes` verified (0: it failed or was corrupt)."""
        rate = self._rates.get(kind)
        if rate is not None:
            with self._lock:
                rate.end(nbytes, self._clock.now())

    def bandwidths(self) -> Bandwidths:
        with self._lock:
            disk, peer, origin = (self._rates[k].rate() for k in KINDS)
        return Bandwidths(disk_bps=disk, peer_bps=peer, origin_bps=origin)
