"""Mapped weight files in 2 MiB page-cache folios (ember/store/page_cache.py), against the running kernel."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ember.store.page_cache import HUGE, AlignedWriter, huge_bytes, prime, thp_enabled

SIZE = 24 * HUGE + 12345   # an unaligned tail, as a GGUF has


def _data() -> bytes:
    return os.urandom(SIZE)


def _small_folios(path: Path, data: bytes) -> None:
    """The file as the store's copies used to leave it: copied by copy_file_range (4 KiB folios)."""
    source = path.with_name("source")
    source.write_bytes(data)
    with open(source, "rb") as src, open(path, "wb") as dst:
        done = 0
        while done < len(data):
            done += os.copy_file_range(src.fileno(), dst.fileno(), len(data) - done, done, done)
    source.unlink()


def _needs_large_folios(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    with open(probe, "wb") as f:
        writer = AlignedWriter(f.fileno())
        writer.write(bytes(4 * HUGE))
        writer.close()
    if huge_bytes(probe)[1] == 0:
        pytest.skip(f"{tmp_path}'s file system or this kernel keeps no 2 MiB page-cache folios (THP off, or a "
                    "file system without large folios)")


def test_aligned_writer_writes_the_bytes_given_in_any_sizes(tmp_path: Path) -> None:
    data = _data()
    path = tmp_path / "w.bin"
    with open(path, "wb") as f:
        writer = AlignedWriter(f.fileno())
        at = 0
        for n in (1, 4095, HUGE - 4096, 3 * HUGE + 7, 17, 8 << 20):
            writer.write(data[at:at + n])
            at += n
        writer.write(memoryview(data)[at:])
        writer.close()
    assert path.read_bytes() == data


def test_a_file_written_aligned_is_mapped_in_huge_pages(tmp_path: Path) -> None:
    _needs_large_folios(tmp_path)
    path, data = tmp_path / "w.bin", _data()
    with open(path, "wb") as f:
        writer = AlignedWriter(f.fileno())
        for i in range(0, SIZE, 3 << 20):   # pieces that straddle the 2 MiB boundaries
            writer.write(data[i:i + (3 << 20)])
        writer.close()
    assert path.read_bytes() == data
    span, huge = huge_bytes(path)
    assert span == 24 * HUGE
    assert huge >= 0.9 * span


def test_prime_turns_small_folios_into_huge_ones_once(tmp_path: Path) -> None:
    _needs_large_folios(tmp_path)
    path = tmp_path / "model.gguf"
    data = _data()
    _small_folios(path, data)
    first = prime(path)
    assert first.huge_before < 0.5 * first.span     # read(2) left it small
    assert first.reread and first.share >= 0.9
    assert prime(path) is first                     # each version of a file once: no second look, no re-read
    span, huge = huge_bytes(path)
    assert huge >= 0.9 * span                       # and it stays so for whoever maps it next
    assert path.read_bytes() == data


def test_prime_leaves_pages_another_mapping_holds(tmp_path: Path) -> None:
    """Pages a process maps are not dropped (fadvise skips them): the file stays readable and as it was."""
    _needs_large_folios(tmp_path)
    import mmap

    path = tmp_path / "model.gguf"
    data = _data()
    _small_folios(path, data)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as held:
        held.madvise(mmap.MADV_WILLNEED)
        assert sum(held[i] for i in range(0, SIZE, 4096)) >= 0   # fault every page into this mapping
        primed = prime(path)
        assert held[:] == data
    assert primed.reread and primed.share < 0.5


def test_a_file_too_small_for_one_huge_page_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"x" * 1000)
    primed = prime(path)
    assert (primed.span, primed.reread, primed.share) == (0, False, 1.0)


def test_a_kernel_that_maps_no_huge_pages_is_left_alone(tmp_path: Path) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    assert not thp_enabled(setting)
    setting.write_text("always [madvise] never\n")
    assert thp_enabled(setting)
    assert not thp_enabled(tmp_path / "missing")
