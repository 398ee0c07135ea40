"""The disk tier: chunk files in the store root; pushed chunks are pinned there, fetched ones are a cache."""

from __future__ import annotations

from pathlib import Path

from ember.store.tiers.files import FileTier, WallClock


class DiskTier(FileTier):
    def __init__(self, root: Path, capacity: int | None, *, fsync: bool = True, clock: WallClock | None = None) -> None:
        super().__init__("disk", root, capacity, fsync=fsync, evict_pinned=False, clock=clock)
