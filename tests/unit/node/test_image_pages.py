"""image_pages.sparsify on image files written here in CRIU's layout: the zero pages of private anonymous areas
leave the pagemap and the pages file; every other page (data, file-backed, shared) stays, so that the memory a
restore rebuilds (listed pages copied in, the rest of an anonymous area zero) is the memory that was dumped."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from ember.node import image_pages
from ember.node.image_pages import PAGE, Entry, ImageFormatError

MAGICS = struct.pack("<II", 0x54564319, 0x56084025)
ANON, HEAP, FILE_PRIVATE = (1 << 0) | (1 << 9), (1 << 0) | (1 << 5) | (1 << 9), (1 << 0) | (1 << 6)
PRESENT, PARENT = 1 << 2, 1 << 0


def message(fields: list[tuple[int, int | bytes]]) -> bytes:
    out = b""
    for number, value in fields:
        if isinstance(value, bytes):
            out += image_pages._put_varint(number << 3 | 2) + image_pages._put_varint(len(value)) + value
        else:
            out += image_pages._field(number, value)
    return out


def write_image(tmp: Path, areas: list[tuple[int, int, int]], entries: list[tuple[int, list[bytes], int]]) -> None:
    vmas = [message([(1, s), (2, e), (3, 0), (4, 0), (5, 3), (6, 0x22), (7, st), (8, 1)]) for s, e, st in areas]
    mm = message([(1, 0x400000), *[(14, v) for v in vmas]])
    (tmp / "mm-1.img").write_bytes(struct.pack("<II", 0x54564319, 0x57492820) + struct.pack("<I", len(mm)) + mm)
    head = message([(1, 7)])
    body, data = MAGICS + struct.pack("<I", len(head)) + head, b""
    for vaddr, pages, flags in entries:
        body += image_pages._encode_entry(Entry(vaddr, len(pages), flags))
        if flags & PRESENT:
            data += b"".join(pages)
    (tmp / "pagemap-1.img").write_bytes(body)
    (tmp / "pages-7.img").write_bytes(data)


def memory(tmp: Path, areas: list[tuple[int, int, int]]) -> dict[int, bytes]:
    """What a restore puts in each page of the anonymous areas and the listed pages."""
    _, messages = image_pages._read_entries(tmp / "pagemap-1.img")
    data, at, out = (tmp / "pages-7.img").read_bytes(), 0, {}
    for s, e, status in areas:
        if status & (1 << 9):
            out |= {a: bytes(PAGE) for a in range(s, e, PAGE)}
    for m in messages[1:]:
        entry = image_pages._pagemap_entry(m)
        if entry.flags & PRESENT:
            for i in range(entry.pages):
                out[entry.vaddr + i * PAGE] = data[at:at + PAGE]
                at += PAGE
    assert at == len(data)
    return out


def page(byte: int) -> bytes:
    return bytes([byte]) * PAGE if byte else bytes(PAGE)


def test_zero_pages_of_anonymous_areas_leave_and_the_restored_memory_is_the_same(tmp_path: Path) -> None:
    base, lib, heap = 0x7F0000000000, 0x7F1000000000, 0x560000000000
    areas = [(base, base + 8 * PAGE, ANON), (lib, lib + 2 * PAGE, FILE_PRIVATE), (heap, heap + 4 * PAGE, HEAP)]
    entries = [(base, [page(1), page(0), page(0), page(2), page(0)], PRESENT),
               (base + 6 * PAGE, [page(0), page(0)], PRESENT),
               (lib, [page(0), page(3)], PRESENT),           # a file's private page of zeros: kept
               (heap, [page(0), page(4)], PRESENT),
               (heap + 2 * PAGE, [page(0)], PARENT)]         # in a parent image: no data, kept as it is
    write_image(tmp_path, areas, entries)
    before = memory(tmp_path, areas)
    result = image_pages.sparsify(tmp_path)
    assert (result.pages_before, result.pages_after) == (11, 5)
    assert result.dropped_bytes == 6 * PAGE
    assert memory(tmp_path, areas) == before
    _, messages = image_pages._read_entries(tmp_path / "pagemap-1.img")
    kept = [image_pages._pagemap_entry(m) for m in messages[1:]]
    assert [(e.vaddr, e.pages) for e in kept] == [(base, 1), (base + 3 * PAGE, 1), (lib, 2), (heap + PAGE, 1),
                                                 (heap + 2 * PAGE, 1)]
    assert kept[-1].flags == PARENT


def test_an_image_whose_pages_do_not_add_up_is_left_as_it_was(tmp_path: Path) -> None:
    base = 0x7F0000000000
    write_image(tmp_path, [(base, base + 2 * PAGE, ANON)], [(base, [page(0), page(1)], PRESENT)])
    (tmp_path / "pages-7.img").write_bytes(page(0))   # one page short
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ImageFormatError, match="pages-7.img"):
        image_pages.sparsify(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_varints_round_trip_and_a_truncated_one_is_refused() -> None:
    for value in (0, 1, 127, 128, 2**32, 2**63 - 1):
        assert image_pages._varint(image_pages._put_varint(value), 0) == (value, len(image_pages._put_varint(value)))
    with pytest.raises(ImageFormatError):
        image_pages._varint(b"\x80\x80", 0)
    assert image_pages._runs(np.array([True, True, False, True])) == [(0, 2), (3, 1)]
