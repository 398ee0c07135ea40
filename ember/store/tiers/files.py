"""A local tier: one file per chunk under a directory, named by digest, with a sqlite index beside them.

Chunks enter through a temp file in tmp/ that is renamed into chunks/ only after its digest was checked, so
a process killed mid-write leaves nothing visible. The index records each chunk's stamp (inode, size, mtime,
ctime) at verification time; a later read trusts a chunk whose stamp still matches and re-hashes one whose
file changed since, dropping it if the bytes are no longer right.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

from ember.errors import StoreError
from ember.store.hashing import digest_file
from ember.store.manifest import Chunk
from ember.store.tiers import Pending, TierUsage
from ember.store.tiers.index import ChunkIndex, Stamp

log = logging.getLogger("ember.store")

_COPY_STEP = 64 << 20


class WallClock(Protocol):
    """Seconds comparable across processes and restarts (LRU order is shared by every process of a node)."""

    def now(self) -> float: ...


class _SystemWallClock:
    def now(self) -> float:
        return time.time()


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


BOOT_ID = _boot_id()


def _stamp(st: os.stat_result) -> Stamp:
    return Stamp(st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def copy_range(src_fd: int, dst_fd: int, size: int, src_offset: int = 0, dst_offset: int = 0) -> None:
    """Copy `size` bytes between two files inside the kernel (no user-space buffer)."""
    done = 0
    while done < size:
        try:
            n = os.copy_file_range(src_fd, dst_fd, min(_COPY_STEP, size - done), src_offset + done, dst_offset + done)
        except OSError:
            n = _sendfile(src_fd, dst_fd, src_offset + done, dst_offset + done, size - done)
        if n <= 0:
            raise StoreError(f"short copy: {done} of {size} bytes")
        done += n


def _sendfile(src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, count: int) -> int:
    os.lseek(dst_fd, dst_offset, os.SEEK_SET)
    return os.sendfile(dst_fd, src_fd, src_offset, min(count, _COPY_STEP))


class FileTier:
    """Implements `ember.store.tiers.Local` over a directory."""

    def __init__(
        self,
        name: str,
        directory: Path,
        capacity: int | None,
        *,
        fsync: bool = False,
        evict_pinned: bool = False,
        clock: WallClock | None = None,
    ) -> None:
        self.name = name
        self.directory = directory
        self.capacity = capacity
        self._fsync = fsync
        self._evict_pinned = evict_pinned
        self._clock = clock or _SystemWallClock()
        try:
            for sub in ("chunks", "tmp", "locks"):
                (directory / sub).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StoreError(f"{name} tier: cannot create {directory}: {err.strerror}") from None
        self._chunk_dir = str(directory / "chunks")
        self._room = threading.Lock()
        self._inflight = 0  # bytes reserved by this process's writes not yet committed
        self._index = ChunkIndex(directory / "index.db")

    # -- reading -----------------------------------------------------------------------------------------------
    def path(self, digest: str) -> str:
        # A plain string: this runs once per tensor on the warm path, where pathlib's cost shows.
        return f"{self._chunk_dir}/{digest[:2]}/{digest}"

    def present(self, chunks: Iterable[Chunk]) -> set[str]:
        wanted = {c.digest: c for c in chunks}
        stamps = self._index.stamps(list(wanted), BOOT_ID)
        ok: set[str] = set()
        for digest, chunk in wanted.items():
            try:
                st = os.stat(self.path(digest))
            except FileNotFoundError:
                if digest in stamps:
                    self._index.delete([digest])
                continue
            stamp = (st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
            if stamps.get(digest) == stamp or self._reverify(chunk, st):
                ok.add(digest)
        return ok

    def indexed(self, chunks: Iterable[Chunk]) -> set[str]:
        """Digests of `chunks` the index lists as verified and trusted in this boot: one query, no stat, no hash.

        A cheap "is it here" for planning (the node asks it on the event loop); a read still checks each
        chunk with `present`, so a chunk lost since only costs a fetch then.
        """
        return set(self._index.stamps([c.digest for c in chunks], BOOT_ID))

    def _reverify(self, chunk: Chunk, st: os.stat_result) -> bool:
        """A chunk file changed since it was verified (or was never indexed): hash it again."""
        path = self.path(chunk.digest)
        try:
            good = st.st_size == chunk.size and digest_file(path) == chunk.digest
        except OSError:
            good = False
        if good:
            self._index.put(chunk.digest, _stamp(st), self._clock.now())
            return True
        log.warning("%s tier: chunk %s is corrupt; dropping it", self.name, chunk.digest)
        self.note_corrupt()
        self.remove([chunk.digest])
        return False

    def copy_to(self, chunk: Chunk, fds: Sequence[int]) -> str | None:
        try:
            src = os.open(self.path(chunk.digest), os.O_RDONLY)
        except OSError as err:
            raise StoreError(f"{self.name} tier: chunk {chunk.digest}: {err.strerror}") from None
        try:
            for fd in fds:
                copy_range(src, fd, chunk.size)
        finally:
            os.close(src)
        return None  # copied inside the kernel: the caller hashes the copy

    # -- writing -----------------------------------------------------------------------------------------------
    def reserve(self, size: int, protect: set[str]) -> bool:
        """Room for `size` bytes, held until the chunk is committed or aborted (in-process writes count too)."""
        if self.capacity is None:
            return True
        if size > self.capacity:
            return False
        with self._room:
            _, used = self._index.used_bytes()
            used += self._inflight
            if used + size > self.capacity:
                victims: list[str] = []
                for digest, chunk_size in self._index.evict_candidates(protect, self._evict_pinned):
                    victims.append(digest)
                    used -= chunk_size
                    if used + size <= self.capacity:
                        break
                self.remove(victims)
            if used + size > self.capacity:
                return False
            self._inflight += size
            return True

    def _release(self, size: int) -> None:
        if self.capacity is not None:
            with self._room:
                self._inflight = max(0, self._inflight - size)

    def begin(self, chunk: Chunk) -> Pending:
        tmp = self.directory / "tmp" / f"{chunk.digest}.{os.getpid()}.{os.urandom(4).hex()}"
        try:
            # No ftruncate to the final size: on ext4 writing into the sparse file measured 3x slower.
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as err:
            raise StoreError(f"{self.name} tier: cannot write {tmp}: {err.strerror}") from None
        return Pending(chunk, tmp, fd)

    def commit(self, pending: Pending, pinned: bool = False) -> None:
        """Make a verified chunk visible. Pushed (pinned) chunks are fsynced first when the tier asks for it;
        cached ones are not (they can be fetched again) and are hashed again after a reboot instead."""
        final = self.path(pending.chunk.digest)
        synced = self._fsync and pinned
        try:
            if synced:
                os.fsync(pending.fd)
            os.close(pending.fd)
            pending.fd = -1
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.rename(pending.tmp, final)
            st = os.stat(final)
        except OSError as err:
            self.abort(pending)
            raise StoreError(f"{self.name} tier: cannot store chunk {pending.chunk.digest}: {err.strerror}") from None
        self._index.put(pending.chunk.digest, _stamp(st), self._clock.now(), pinned, "" if synced else BOOT_ID)
        self._release(pending.chunk.size)

    def abort(self, pending: Pending) -> None:
        self._release(pending.chunk.size)
        if pending.fd >= 0:
            os.close(pending.fd)
            pending.fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pending.tmp)

    def pin(self, chunks: Iterable[Chunk]) -> None:
        """Mark chunks as owned here (pushed, perhaps held nowhere else): never evicted."""
        for chunk in chunks:
            st = os.stat(self.path(chunk.digest))
            self._index.put(chunk.digest, _stamp(st), self._clock.now(), pinned=True)

    def note_corrupt(self) -> None:
        self._index.bump("corrupt_detected")

    def touch(self, digests: Iterable[str]) -> None:
        self._index.touch(digests, self._clock.now())

    @contextlib.contextmanager
    def lock(self, digest: str) -> Iterator[None]:
        fd = os.open(self.directory / "locks" / f"{digest[:3]}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    # -- housekeeping ------------------------------------------------------------------------------------------
    def remove(self, digests: Iterable[str]) -> int:
        gone = list(digests)
        for digest in gone:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(digest))
        self._index.delete(gone)
        return len(gone)

    def drop(self, digests: Iterable[str]) -> int:
        """Remove chunks a caller no longer wants here (not for room: `reserve` evicts for that); the bytes they
        held. Under the room lock, so this process's reservations count without them at once. A process that
        mapped one keeps its pages until it unmaps them (an unlinked file lives while it is mapped)."""
        gone = list(digests)
        freed = 0
        with self._room:
            for digest in gone:
                path = self.path(digest)
                with contextlib.suppress(FileNotFoundError):
                    size = os.stat(path).st_size
                    os.unlink(path)
                    freed += size
            self._index.delete(gone)
        return freed

    def digests(self) -> set[str]:
        on_disk = {p.name for p in (self.directory / "chunks").glob("*/*")}
        return on_disk | set(self._index.rows())

    def usage(self) -> TierUsage:
        count, used = self._index.used_bytes()
        return TierUsage(
            self.name, str(self.directory), count, used, self.capacity, self._index.counter("corrupt_detected")
        )

    def scrub(self) -> list[str]:
        bad: list[str] = []
        for digest, row in self._index.rows().items():
            path = self.path(digest)
            try:
                good = digest_file(path) == digest and os.path.getsize(path) == row.stamp.size
            except OSError:
                good = False
            if not good:
                bad.append(digest)
        if bad:
            self._index.bump("corrupt_detected", len(bad))
            self.remove(bad)
        return bad

    def clean(self) -> int:
        removed = 0
        for tmp in (self.directory / "tmp").iterdir():
            pid = int(tmp.name.split(".")[1]) if tmp.name.count(".") == 2 else -1
            if pid != os.getpid() and not _alive(pid):
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                    removed += 1
        return removed

    def close(self) -> None:
        self._index.close()


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
