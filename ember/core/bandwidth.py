"""How fast a node moves bytes, as its own transfers measure it (no clock of its own: callers pass `now`).

Placement costs a start as bytes over bandwidths (ember/core/placement.py): a node's disk, its network to its
peers, the origin. `TransferRate` measures one of them from the transfers that really happen: each transfer
`begin`s and `end`s with its byte count; the rate is bytes over the time at least one transfer was in flight.
Parallel transfers (the store fetches several chunks at once) share that time, so the rate is what the node
gets in all, not what one connection gets. Both sums decay with the time spent transferring (`half_life_s` of
busy time), so recent transfers weigh more and an idle node keeps its last figure. Nothing is reported until
`min_bytes` were seen: a few small transfers measure latency, not bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bandwidths:
    """A node's measured figures, bytes per second; None where it has not measured one yet."""

    disk_bps: float | None = None     # reading chunks from its disk tier
    peer_bps: float | None = None     # fetching chunks from other nodes
    origin_bps: float | None = None   # fetching chunks from the origin


class TransferRate:
    """Bytes per second over the busy time of one kind of transfer, decayed by busy time."""

    def __init__(self, *, half_life_s: float = 30.0, min_bytes: int = 16 << 20) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, not {half_life_s}")
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, not {min_bytes}")
        self.half_life_s, self.min_bytes = half_life_s, min_bytes
        self._bytes = 0.0      # decayed bytes
        self._busy = 0.0       # decayed seconds with a transfer in flight
        self._seen = 0         # bytes ever (not decayed): the threshold for reporting at all
        self._active = 0
        self._last: float | None = None

    def begin(self, now: float) -> None:
        self._advance(now)
        self._active += 1

    def end(self, nbytes: int, now: float) -> None:
        """A transfer that `begin` started is over, having moved `nbytes` (0: it failed; its time still counts)."""
        self._advance(now)
        self._active = max(0, self._active - 1)
        self._bytes += nbytes
        self._seen += nbytes

    def rate(self) -> float | None:
        """Bytes per second; None before `min_bytes` were seen or while no time was measured."""
        if self._seen < max(1, self.min_bytes) or self._busy <= 0:
            return None
        return self._bytes / self._busy

    def _advance(self, now: float) -> None:
        last, self._last = self._last, now if self._last is None else max(self._last, now)
        if last is None or self._active == 0 or now <= last:
            return
        dt = now - last
        keep = 0.5 ** (dt / self.half_life_s)
        self._bytes *= keep
        self._busy = self._busy * keep + dt
