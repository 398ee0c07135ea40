"""Copying a remote chunk into tier files: the part shared by the HTTP and S3 origins.

A chunk up to the part size comes in one request, hashed as it arrives; a larger one as parallel ranged
requests (parts arrive out of order, so the caller hashes the written file).

Received bytes pass through a small reused per-thread buffer on their way to the tier files; at 1 MiB it
stays in the CPU cache between the socket read, the hash and the writes (16 MiB measured markedly slower
here). Each buffer-full is hashed (when the caller hashes as bytes arrive) and written at its offset into
every destination file.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Protocol

import blake3

from ember.errors import StoreError, TierUnavailable
from ember.store.manifest import Chunk

RECV_BUFFER = 1 << 20
Hasher = blake3.blake3


# Copies bytes [start, end) of the chunk into the destination files, hashing them on the way when given a hasher.
CopyPart = Callable[[tuple[int, int], "Hasher | None"], object]


def chunk_path(chunk: Chunk) -> str:
    """Where a chunk lives under an origin's root."""
    return f"chunks/{chunk.digest[:2]}/{chunk.digest}"


def copy_chunk(chunk: Chunk, part_size: int, pool: Executor, copy_part: CopyPart, *,
               hash_single: bool = True) -> str | None:
    """The chunk's digest when it came in one hashed request; None when the caller must hash the written file
    (parts, a spliced body, or an empty chunk: no request at all)."""
    spans = [(start, min(start + part_size, chunk.size)) for start in range(0, chunk.size, part_size)]
    if len(spans) == 1:
        hasher = blake3.blake3() if hash_single else None
        copy_part(spans[0], hasher)
        return None if hasher is None else hasher.hexdigest()
    for fut in [pool.submit(copy_part, span, None) for span in spans]:
        fut.result()
    return None


class Body(Protocol):
    def readinto(self, buffer: memoryview, /) -> int | None: ...


class BodyCopier:
    """Writes response bodies of one remote (named in errors, e.g. "origin URL") into tier files."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self._local = threading.local()

    def buffer(self) -> memoryview:
        buf: bytearray | None = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = bytearray(RECV_BUFFER)
        return memoryview(buf)

    def copy(self, body: Body, what: str, span: tuple[int, int], fds: Sequence[int], hasher: Hasher | None) -> None:
        """Bytes `span` of `what` from `body` into every fd at their offsets; a body that ends early is an error."""
        buf = self.buffer()
        offset, end = span
        while offset < end:
            want = min(len(buf), end - offset)
            got = 0
            while got < want:
                n = body.readinto(buf[got:want])
                if not n:
                    raise TierUnavailable(f"{self.origin}: {what} ended {end - offset - got} bytes early")
                got += n
            if hasher is not None:
                hasher.update(buf[:got])
            self.write(fds, buf[:got], offset)
            offset += got

    def write(self, fds: Sequence[int], data: bytes | memoryview, offset: int) -> None:
        try:
            for fd in fds:
                os.pwrite(fd, data, offset)
        except OSError as err:
            raise StoreError(f"cannot write a chunk fetched from {self.origin}: {err.strerror}") from None
