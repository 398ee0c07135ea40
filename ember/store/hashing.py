"""Chunk digests: blake3 (cryptographic, several GB/s per core and multithreaded on large inputs)."""

from __future__ import annotations

import os
from pathlib import Path

import blake3

# Below this size, threading costs more than it saves.
_THREADED_FROM = 4 << 20


def digest_bytes(data: bytes | bytearray | memoryview) -> str:
    threads = blake3.blake3.AUTO if len(data) >= _THREADED_FROM else 1
    return blake3.blake3(data, max_threads=threads).hexdigest()


def digest_file(path: str | Path, offset: int = 0, length: int | None = None) -> str:
    """Digest of `length` bytes of a file from `offset` (the whole file by default)."""
    size = os.path.getsize(path)
    length = size - offset if length is None else length
    if offset == 0 and length == size:
        if size == 0:
            return blake3.blake3().hexdigest()
        return blake3.blake3(max_threads=blake3.blake3.AUTO).update_mmap(str(path)).hexdigest()
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
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
