"""A GGUF's vocabulary without its weights: the file's head (its metadata: tokenizer, chat template, context) as a
GGUF of its own with no tensors, which llama.cpp loads with `vocab_only` as it loads the whole file.

The gateway's prompt check (ember.runtimes.llm.PromptCheck) needs only the tokenizer. For a model in the weight
store (`store:NAME`) the gateway reads the head from the GGUF's first chunks (`store_vocabulary`): a few MiB (a
262k-token vocabulary is ~6 MiB of metadata) of a file that may be gigabytes, brought into the node's store as any
chunk is (the instance that loads the model later finds them there).

The layout (GGUF v2 and v3, little-endian): magic `GGUF`, version (u32), tensor count (u64), key-value count
(u64), the key-values (key: a string, u64 length and bytes; a u32 type; the value), then the tensors' infos and
their data. `vocabulary_gguf` walks the key-values only, from pieces of the file as they come, and writes the head
with a tensor count of 0, padded to the file's alignment.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from ember.errors import ModelNotReady

if TYPE_CHECKING:
    from ember.store import WeightStore

MAGIC = b"GGUF"
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # type -> bytes (8 string, 9 array)
_STRING, _ARRAY, _UINT32 = 8, 9, 4
MAX_HEAD_BYTES = 1 << 30   # metadata past this is not a vocabulary
DEFAULT_ALIGNMENT = 32


class _Reader:
    """Bytes of a file read through its pieces in order, kept from the start (the head is written out whole)."""

    def __init__(self, pieces: Iterable[bytes], where: str) -> None:
        self._pieces: Iterator[bytes] = iter(pieces)
        self.buf, self.pos, self.where = bytearray(), 0, where

    def take(self, n: int) -> memoryview:
        while len(self.buf) < self.pos + n:
            piece = next(self._pieces, None)
            if piece is None:
                raise ModelNotReady(f"{self.where}: the GGUF ends inside its metadata (at byte {len(self.buf)})")
            self.buf += piece
            if len(self.buf) > MAX_HEAD_BYTES:
                raise ModelNotReady(f"{self.where}: the GGUF's metadata is larger than {MAX_HEAD_BYTES} bytes")
        out = memoryview(self.buf)[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def string(self) -> bytes:
        return bytes(self.take(self.u64()))


def vocabulary_gguf(pieces: Iterable[bytes], where: str = "gguf") -> bytes:
    """The head of the GGUF whose bytes `pieces` yields in order (read no further than its metadata), as a GGUF with
    no tensors. ModelNotReady naming `where` when it is not a GGUF this reads."""
    r = _Reader(pieces, where)
    if bytes(r.take(4)) != MAGIC:
        raise ModelNotReady(f"{where}: not a GGUF file (no GGUF magic)")
    version = r.u32()
    if version not in (2, 3):
        raise ModelNotReady(f"{where}: GGUF version {version} (this reads versions 2 and 3, little-endian)")
    r.u64()   # the tensors: none in the head
    count = r.u64()
    start = r.pos
    alignment = DEFAULT_ALIGNMENT
    for _ in range(count):
        key = r.string()
        kind = r.u32()
        if key == b"general.alignment" and kind == _UINT32:
            alignment = r.u32()
            continue
        _skip(r, kind)
    head = MAGIC + struct.pack("<IQQ", version, 0, count) + bytes(r.buf[start:r.pos])
    return head + b"\0" * (-len(head) % max(1, alignment))


def _skip(r: _Reader, kind: int) -> None:
    if kind in _FIXED:
        r.take(_FIXED[kind])
    elif kind == _STRING:
        r.take(r.u64())
    elif kind == _ARRAY:
        item, n = r.u32(), r.u64()
        if item in _FIXED:
            r.take(_FIXED[item] * n)
        else:
            for _ in range(n):
                _skip(r, item)
    else:
        raise ModelNotReady(f"{r.where}: a GGUF value of unknown type {kind} at byte {r.pos}")


def store_vocabulary(store: WeightStore, ref: str, where: str) -> bytes:
    """The vocabulary GGUF of model `ref`'s .gguf file in `store` (the first by path, as the llm runtime picks it),
    read from as many of its first chunks as its metadata spans, each brought into a local tier as a load would."""
    manifest = store.manifest(ref)
    ggufs = sorted((f for f in manifest.files if f.path.endswith(".gguf")), key=lambda f: f.path)
    if not ggufs:
        raise ModelNotReady(f"{where}: the stored model holds no .gguf file")
    entry = ggufs[0]
    protect = {c.digest for c in entry.chunks}

    def pieces() -> Iterator[bytes]:
        for chunk in entry.chunks:
            tier = store.ensure(chunk, manifest.key, protect)
            with open(tier.path(chunk.digest), "rb") as f:
                yield f.read(chunk.size)

    return vocabulary_gguf(pieces(), f"{where}: {entry.path}")
