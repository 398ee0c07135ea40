"""The memory tier: chunk files on a tmpfs (/dev/shm), one copy per node mapped by every instance."""

from __future__ import annotations

from pathlib import Path

from ember.store.tiers.files import FileTier, WallClock


class MemoryTier(FileTier):
    """Never fsynced (RAM does not survive a reboot anyway); always a cache, so pinned chunks may go too."""

    def __init__(self, directory: Path, capacity: int, clock: WallClock | None = None) -> None:
        super().__init__("memory", directory, capacity, fsync=False, evict_pinned=True, clock=clock)
