"""What a node shares with its peers: the file of a chunk it holds, found by digest (memory tier first), and the
manifests in its root (a process image's: ember/node/image_sharing.py).

Read only, and no index or store is opened: the gateway only stats files. A chunk file is visible only once
its digest was checked (tiers write through a temp file), and the peer that receives it checks it again.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ember.store.config import StoreConfig
from ember.wire.refs import ModelRef

DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ChunkFile:
    path: str
    size: int


class SharedChunks:
    """Implements the gateway's `ChunkFiles` over a store's local tier directories."""

    def __init__(self, config: StoreConfig) -> None:
        dirs = [config.memory_dir] if config.memory_enabled and config.memory_dir is not None else []
        self._dirs = [str(d / "chunks") for d in [*dirs, config.root]]
        self._root = config.root

    def find(self, digest: str) -> ChunkFile | None:
        """The chunk's file in the fastest tier holding it; None when none does (or the digest is malformed)."""
        if not DIGEST.fullmatch(digest):
            return None
        for base in self._dirs:
            path = f"{base}/{digest[:2]}/{digest}"
            try:
                st = os.stat(path)
            except OSError:
                continue
            return ChunkFile(path, st.st_size)
        return None

    def manifest(self, ref: ModelRef) -> bytes | None:
        """The text of a model's manifest in the store's root; None when it has none."""
        try:
            return (self._root / ref.manifest_path).read_bytes()
        except OSError:
            return None
