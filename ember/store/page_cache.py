"""Mapped weight files in huge pages: the page cache holding a file in 2 MiB folios, which every process that maps
the file then maps with one page-table entry per 2 MiB instead of 512.

Why it matters: a fork copies no page-table entries of a file mapping, and a new process has none, so every
process that starts from a template or a zygote maps the weights again before its first token. An 8B-shaped
GGUF (4.2 GB) in 4 KiB folios is 64,517 faults in a forked replica's first forward pass (measured: +210-380 ms
over the template's own); in 2 MiB folios, 4,844 (the rest are its own buffers) and no measurable difference.
llama.cpp's MAP_POPULATE at load falls from 0.50 s to 0.14 s for the same file.

Linux fills the page cache with 2 MiB folios when a file system supports large folios (ext4 and xfs on 6.x) and
either the file is written in aligned 2 MiB pieces (`AlignedWriter`), or its pages are read in through a mapping
advised MADV_HUGEPAGE. `prime` makes a file so: it checks, and if the cache holds it in small folios (a copy by
copy_file_range, reads by read(2)), drops the file's clean, unmapped pages and reads them in again that way (a
re-read from disk, once per version of the file: at its first deploy). Pages another process maps cannot be dropped
and stay as they are; a file system without large folios (tmpfs without `huge=`) keeps small ones: both are only
slower.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("ember.store")

HUGE = 2 << 20                  # a PMD's span on x86-64 and arm64 (4 KiB base pages)
_PROT_READ, _MAP_SHARED = 1, 1
_MADV_HUGEPAGE, MADV_POPULATE_READ = 14, 22   # MADV_POPULATE_READ: Linux 5.14+
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


# mmap, munmap and madvise through ctypes (which lets go of the GIL during the call; mmap.madvise does not), for
# every module of ember that pages mapped weights in.
LIBC = _libc()


@dataclass(frozen=True)
class Primed:
    """What `prime` found and left: bytes of the file's 2 MiB-aligned span mapped huge, before and after."""

    path: str
    span: int
    huge_before: int
    huge_after: int
    reread: bool
    seconds: float

    @property
    def share(self) -> float:
        return self.huge_after / self.span if self.span else 1.0


def huge_bytes(path: Path) -> tuple[int, int]:
    """(bytes of `path`'s 2 MiB-aligned span, of those the page cache holds in 2 MiB folios). Maps the file
    advised MADV_HUGEPAGE and populates it: pages not cached yet are read in as 2 MiB folios on the way."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        span = size - size % HUGE
        if span == 0:
            return 0, 0
        addr = LIBC.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            LIBC.madvise(addr, size, _MADV_HUGEPAGE)        # EINVAL without THP: then simply none is huge
            if LIBC.madvise(addr, size, MADV_POPULATE_READ) != 0:
                raise OSError(ctypes.get_errno(), f"madvise(POPULATE_READ) {path}")
            return span, min(span, _pmd_mapped(addr))
        finally:
            LIBC.munmap(addr, size)
    finally:
        os.close(fd)


def _pmd_mapped(addr: int) -> int:
    """FilePmdMapped of this process's mapping that starts at `addr`, in bytes (0 if the kernel does not say)."""
    head = f"{addr:x}-"
    found = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if not found:
                found = line.startswith(head)
            elif line.startswith("FilePmdMapped:"):
                return int(line.split()[1]) * 1024
            elif line.startswith("VmFlags:"):
                return 0
    return 0


_PRIMED: dict[tuple[int, int, int, int], Primed] = {}   # by (device, inode, mtime, size): each version once
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_enabled(setting: Path = THP) -> bool:
    """Whether this kernel maps huge pages at all (`never` maps none, 2 MiB folios or not)."""
    try:
        return "[never]" not in setting.read_text()
    except OSError:
        return False


def prime(path: Path, *, enough: float = 0.9) -> Primed:
    """Leave `path` in the page cache in 2 MiB folios where Linux can (see the module docstring). Each version of a
    file is primed once per process: a later call answers what the first found, with no work (a model deployed
    again, or prepared again on a request's path, re-reads nothing). Nothing is done where the kernel maps no huge
    pages."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
    found = _PRIMED.get(key)
    if found is None:
        found = _PRIMED[key] = _prime(path, enough) if thp_enabled() else Primed(str(path), 0, 0, 0, False, 0.0)
    return found


def _prime(path: Path, enough: float) -> Primed:
    started = time.monotonic()
    span, before = huge_bytes(path)
    after, reread = before, False
    if span and before < enough * span:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)                                         # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        _, after = huge_bytes(path)
        reread = True
    primed = Primed(str(path), span, before, after, reread, time.monotonic() - started)
    if reread:
        log.info("%s: %.0f%% in 2 MiB pages (was %.0f%%), re-read in %.2f s", path, 100 * primed.share,
                 100 * before / span, primed.seconds)
    return primed


class AlignedWriter:
    """Writes a file front to back in 2 MiB pieces at 2 MiB-aligned offsets, whatever the sizes it is given, so
    that the page cache holds what it wrote in 2 MiB folios (ext4 on 6.x; copy_file_range leaves 4 KiB ones)."""

    def __init__(self, fd: int, offset: int = 0) -> None:
        self.fd, self.offset = fd, offset   # `offset`: where the next byte goes
        self._held = bytearray()            # bytes short of the next 2 MiB boundary

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self._held or self.offset % HUGE:
            take = min(len(view), HUGE - (self.offset + len(self._held)) % HUGE)
            self._held += view[:take]
            view = view[take:]
            if (self.offset + len(self._held)) % HUGE:
                return
            self._put(self._held)
            self._held = bytearray()
        whole = len(view) - len(view) % HUGE
        for start in range(0, whole, HUGE):
            self._put(view[start:start + HUGE])
        self._held += view[whole:]

    def close(self) -> None:
        """Write what is left (the file's tail)."""
        if self._held:
            self._put(self._held)
            self._held = bytearray()

    def _put(self, data: bytes | bytearray | memoryview) -> None:
        view, done = memoryview(data), 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], self.offset + done)
        self.offset += done
