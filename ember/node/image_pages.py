"""Leave the zero-filled pages of a process's private anonymous memory out of its CRIU image.

CRIU dumps every page present in memory that is not the kernel's shared zero page, so a buffer that was cleared
and never written since is written to the image in full: llama.cpp clears its whole KV cache when it loads, and
allocators hand out zeroed memory the model touched but left zero (a third of SmolLM2's image; for a model with a
long context, most of it). On restore CRIU maps a private anonymous area afresh, which reads as zeros, and copies
in the pages its pagemap lists: a zero page the pagemap does not list is restored exactly as it was. So `sparsify`
rewrites an image's pagemap and pages files without the pages of zeros in private anonymous areas (the heap and
the stack included); pages of private file mappings stay (one left out would read the file's bytes instead), as do
those of every other kind of area.

The image files (CRIU's `images/*.proto`): `pagemap-PID.img` is two magics, then length-prefixed protobuf entries,
a `pagemap_head` (the id N of its `pages-N.img`) and `pagemap_entry`s (vaddr, page count, flags); `pages-N.img` is
the present entries' pages, back to back in pagemap order; `mm-PID.img` holds the areas (`vma_entry`: start, end,
status).
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PAGE = 4096
_PE_PARENT, _PE_PRESENT = 1 << 0, 1 << 2
_VMA_ANON_PRIVATE = 1 << 9
_NOT_PLAIN = (1 << 2) | (1 << 3) | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 10) | (1 << 11) | (1 << 12) | \
    (1 << 13) | (1 << 14) | (1 << 15) | (1 << 16) | (1 << 17)   # vsyscall, vdso, files, shared, sysv, socket ...
_PAGEMAP = re.compile(r"pagemap-(\d+)\.img")


class ImageFormatError(ValueError):
    """An image file is not laid out as this module reads it (nothing was changed)."""


@dataclass(frozen=True)
class Entry:
    vaddr: int
    pages: int
    flags: int
    extra: bytes = b""   # fields this module does not change, kept as they were (in_parent)


@dataclass(frozen=True)
class Sparsified:
    pages_before: int
    pages_after: int

    @property
    def dropped_bytes(self) -> int:
        return (self.pages_before - self.pages_after) * PAGE


# ----- protobuf, as far as these three messages need ------------------------------------------------------------

def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ImageFormatError("a varint runs past its message")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def _fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field of a message."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
            yield number, wire, value
        elif wire == 2:
            size, at = _varint(data, at)
            if at + size > len(data):
                raise ImageFormatError("a field runs past its message")
            yield number, wire, data[at:at + size]
            at += size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            yield number, wire, data[at:at + width]
            at += width
        else:
            raise ImageFormatError(f"wire type {wire} is not read here")


def _put_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, value: int) -> bytes:
    return _put_varint(number << 3) + _put_varint(value)


# ----- the image files -------------------------------------------------------------------------------------------

def _read_entries(path: Path) -> tuple[bytes, list[bytes]]:
    """The file's two magics and its length-prefixed messages."""
    data = path.read_bytes()
    if len(data) < 8:
        raise ImageFormatError(f"{path.name}: shorter than its magics")
    head, at, messages = data[:8], 8, []
    while at < len(data):
        if at + 4 > len(data):
            raise ImageFormatError(f"{path.name}: an entry's length runs past the end")
        (size,) = struct.unpack_from("<I", data, at)
        if at + 4 + size > len(data):
            raise ImageFormatError(f"{path.name}: an entry runs past the end")
        messages.append(data[at + 4:at + 4 + size])
        at += 4 + size
    return head, messages


def _pagemap_entry(message: bytes) -> Entry:
    vaddr = compat = flags = 0
    pages: int | None = None
    has_flags, extra = False, b""
    for number, _, value in _fields(message):
        if number == 1:
            vaddr = int(value)
        elif number == 2:
            compat = int(value)
        elif number == 4:
            flags, has_flags = int(value), True
        elif number == 5:
            pages = int(value)
        elif number == 3:
            extra = _field(3, int(value))
            if value:
                flags |= _PE_PARENT
        else:
            raise ImageFormatError(f"pagemap entry field {number} is not read here")
    if not has_flags and not flags & _PE_PARENT:
        flags = _PE_PRESENT   # an image of an older CRIU (criu/pagemap.c init_compat_pagemap_entry)
    return Entry(vaddr, compat if pages is None else pages, flags, extra)


def _encode_entry(entry: Entry) -> bytes:
    body = _field(1, entry.vaddr) + _field(2, min(entry.pages, 0xFFFFFFFF)) + entry.extra + \
        _field(4, entry.flags) + _field(5, entry.pages)
    return struct.pack("<I", len(body)) + body


def plain_anonymous_areas(mm: bytes) -> list[tuple[int, int]]:
    """(start, end) of each private anonymous area (heap and stack included) of an `mm_entry`."""
    areas = []
    for number, _, value in _fields(mm):
        if number != 14 or not isinstance(value, bytes):
            continue
        start = end = status = 0
        for n, _, v in _fields(value):
            if n == 1:
                start = int(v)
            elif n == 2:
                end = int(v)
            elif n == 7:
                status = int(v)
        if status & _VMA_ANON_PRIVATE and not status & _NOT_PLAIN:
            areas.append((start, end))
    return areas


def _droppable(entry: Entry, areas: list[tuple[int, int]]) -> np.ndarray:
    """Per page of the entry: inside a private anonymous area."""
    addrs = entry.vaddr + PAGE * np.arange(entry.pages, dtype=np.uint64)
    inside = np.zeros(entry.pages, dtype=bool)
    last = entry.vaddr + entry.pages * PAGE
    for start, end in areas:
        if start < last and end > entry.vaddr:
            inside |= (addrs >= start) & (addrs < end)
    return inside


def _runs(keep: np.ndarray) -> list[tuple[int, int]]:
    """(first, count) of each run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], keep.astype(np.int8), [0]))))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def sparsify(images: Path) -> Sparsified:
    """Rewrite each process's pagemap and pages files in `images` without the zero pages of its private anonymous
    areas. Each file is replaced whole (written beside it, then renamed); a layout it does not know raises
    ImageFormatError before anything is written."""
    before = after = 0
    for pagemap in sorted(images.glob("pagemap-*.img")):
        match = _PAGEMAP.fullmatch(pagemap.name)
        if match is None:
            continue   # pagemap-shmem-*: shared memory, not this process's own
        b, a = _sparsify_process(images, pagemap, match.group(1))
        before, after = before + b, after + a
    return Sparsified(before, after)


def _sparsify_process(images: Path, pagemap: Path, pid: str) -> tuple[int, int]:
    head, messages = _read_entries(pagemap)
    _, mm_messages = _read_entries(images / f"mm-{pid}.img")
    if len(mm_messages) != 1 or not messages:
        raise ImageFormatError(f"mm-{pid}.img or {pagemap.name}: not one mm entry and a pagemap head")
    pages_id = next((int(v) for n, _, v in _fields(messages[0]) if n == 1), None)
    pages_file = images / f"pages-{pages_id}.img"
    areas = plain_anonymous_areas(mm_messages[0])
    entries = [_pagemap_entry(m) for m in messages[1:]]
    data = np.memmap(pages_file, dtype=np.uint8, mode="r") if pages_file.stat().st_size else np.zeros(0, np.uint8)
    present = sum(e.pages for e in entries if e.flags & _PE_PRESENT)
    if present * PAGE != len(data):
        raise ImageFormatError(f"{pages_file.name}: {len(data)} bytes for {present} pages")
    new_map, new_pages = pagemap.with_suffix(".img.new"), pages_file.with_suffix(".img.new")
    kept, at = 0, 0
    with open(new_map, "wb") as out_map, open(new_pages, "wb") as out_pages:
        out_map.write(head + struct.pack("<I", len(messages[0])) + messages[0])
        for entry in entries:
            if not entry.flags & _PE_PRESENT:
                out_map.write(_encode_entry(entry))
                continue
            block = data[at:at + entry.pages * PAGE]
            at += entry.pages * PAGE
            zero = ~block.view(np.uint64).reshape(entry.pages, PAGE // 8).any(axis=1)
            for first, count in _runs(~(zero & _droppable(entry, areas))):
                out_map.write(_encode_entry(Entry(entry.vaddr + first * PAGE, count, entry.flags, entry.extra)))
                out_pages.write(block[first * PAGE:(first + count) * PAGE].tobytes())
                kept += count
    del data
    os.replace(new_pages, pages_file)
    os.replace(new_map, pagemap)
    return present, kept
