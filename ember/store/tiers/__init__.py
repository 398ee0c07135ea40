"""Store tiers: memory and disk (local files, mappable) and remote origins (HTTP, S3), behind two small Protocols."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ember.store.manifest import Chunk


@dataclass(frozen=True)
class TierUsage:
    name: str
    location: str
    chunks: int
    used: int
    capacity: int | None
    corrupt_detected: int = 0


class Source(Protocol):
    """A tier that chunks can be read from: copies a chunk's bytes into files opened for writing."""

    name: str

    def copy_to(self, chunk: Chunk, fds: Sequence[int]) -> str | None:
        """Write the chunk's bytes at offset 0 of every fd; return their digest when it was computed on the way
        (the caller checks it, or hashes the written file when None)."""
        ...


class Remote(Source, Protocol):
    """A remote origin: chunks and manifests of a store root, read only."""

    def fetch(self, path: str) -> bytes | None:
        """A small file under the root (a manifest), or None when the origin has no such file."""
        ...


@dataclass
class Pending:
    """A chunk being written to a local tier: a temp file that becomes visible only on commit."""

    chunk: Chunk
    tmp: Path
    fd: int


class Local(Source, Protocol):
    """A local tier: chunk files that can be mapped, an index with stamps and LRU, and a capacity."""

    name: str
    directory: Path

    def present(self, chunks: Iterable[Chunk]) -> set[str]:
        """Digests of the chunks held here and still intact (a changed file is re-hashed, a bad one dropped)."""
        ...

    def path(self, digest: str) -> str: ...

    def reserve(self, size: int, protect: set[str]) -> bool:
        """Make room for `size` bytes by evicting least recently used chunks not in `protect`."""
        ...

    def begin(self, chunk: Chunk) -> Pending: ...

    def commit(self, pending: Pending, pinned: bool = False) -> None: ...

    def abort(self, pending: Pending) -> None: ...

    def touch(self, digests: Iterable[str]) -> None: ...

    def lock(self, digest: str) -> AbstractContextManager[None]:
        """Held (across processes) while one process brings this chunk into the store."""
        ...

    def remove(self, digests: Iterable[str]) -> int: ...

    def digests(self) -> set[str]: ...

    def usage(self) -> TierUsage: ...

    def scrub(self) -> list[str]:
        """Re-hash every chunk; drop and return the corrupt ones."""
        ...

    def clean(self) -> int:
        """Remove temp files left by processes that died mid-write; return how many."""
        ...
