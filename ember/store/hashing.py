"""Chunk digests: blake3 (cryptographic, several GB/s per core and multithreaded on large inputs).

blake3's threads are a process-wide pool that never stops: a process that must stay single-threaded to fork
safely (a template that saves KV-prefix snapshots) hashes `one_thread()`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import blake3

# Below this size, threading costs more than it saves.
_THREADED_FROM = 4 << 20


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Digests made in this block (in any thread: the store hashes in its pool) start no threads. Blocks may
    overlap (two threads of a node keeping snapshots): digests are one-threaded until the last one ends."""
    global _forced
    with _forced_lock:
        _forced += 1
    try:
        yield
    finally:
        with _forced_lock:
            _forced -= 1


_forced = 0   # blocks open
_forced_lock = threading.Lock()


def _auto() -> int:
    return 1 if _forced else blake3.blake3.AUTO


def digest_bytes(data: bytes | bytearray | memoryview) -> str:
    threads = _auto() if len(data) >= _THREADED_FROM else 1
    return blake3.blake3(data, max_threads=threads).hexdigest()


def digest_file(path: str | Path, offset: int = 0, length: int | None = None) -> str:
    """Digest of `length` bytes of a file from `offset` (the whole file by default)."""
    size = os.path.getsize(path)
    length = size - offset if length is None else length
    if offset == 0 and length == size:
        if size == 0:
            return blake3.blake3().hexdigest()
        return blake3.blake3(max_threads=_auto()).update_mmap(str(path)).hexdigest()
    hasher = blake3.blake3(max_threads=_auto())
    with open(path, "rb") as f:
        f.seek(offset)
        remaining = length
        while remaining:
            block = f.read(min(remaining, 16 << 20))
            if not block:
                raise OSError(f"{path}: short read at {offset + length - remaining}")
            hasher.update(block)
            remaining -= len(block)
    return hasher.hexdigest()
