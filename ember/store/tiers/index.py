"""The index of a local tier (sqlite, shared by every process on the node): sizes, stamps, last use, pins."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ember.errors import StoreError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    digest TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    ino INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    ctime_ns INTEGER NOT NULL,
    used REAL NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0,
    boot TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS chunks_used ON chunks (pinned, used);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
_COLUMNS = "digest, size, ino, mtime_ns, ctime_ns, used, pinned"


@dataclass(frozen=True)
class Stamp:
    """What a chunk file looked like when it was verified; any write or utime changes ctime."""

    size: int
    ino: int
    mtime_ns: int
    ctime_ns: int


@dataclass(frozen=True)
class Row:
    digest: str
    stamp: Stamp
    used: float
    pinned: bool


class ChunkIndex:
    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(path, timeout=60, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as err:
            raise StoreError(f"tier index {path}: {err}") from None

    @contextmanager
    def _tx(self, immediate: bool = False) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
                try:
                    yield self._db
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            except sqlite3.Error as err:
                raise StoreError(f"tier index: {err}") from None

    def rows(self, digests: Iterable[str] | None = None) -> dict[str, Row]:
        with self._tx() as db:
            if digests is None:
                cur = db.execute(f"SELECT {_COLUMNS} FROM chunks")
                found = cur.fetchall()
            else:
                wanted = list(digests)
                found = []
                for i in range(0, len(wanted), 900):
                    part = wanted[i : i + 900]
                    marks = ",".join("?" * len(part))
                    found += db.execute(
                        f"SELECT {_COLUMNS} FROM chunks WHERE digest IN ({marks})",
                        part,
                    ).fetchall()
        return {r[0]: Row(r[0], Stamp(r[1], r[2], r[3], r[4]), r[5], bool(r[6])) for r in found}

    def stamps(self, digests: list[str], boot: str) -> dict[str, tuple[int, int, int, int]]:
        """(size, ino, mtime_ns, ctime_ns) of each indexed digest: the warm path's one query.

        A chunk written without fsync during another boot is left out: a crash may have torn it, so it is
        hashed again before it is trusted.
        """
        found: dict[str, tuple[int, int, int, int]] = {}
        with self._tx() as db:
            for i in range(0, len(digests), 900):
                part = digests[i : i + 900]
                marks = ",".join("?" * len(part))
                for d, *stamp in db.execute(
                    f"SELECT digest, size, ino, mtime_ns, ctime_ns FROM chunks WHERE digest IN ({marks}) "
                    "AND boot IN ('', ?)", [*part, boot]
                ):
                    found[d] = (stamp[0], stamp[1], stamp[2], stamp[3])
        return found

    def put(self, digest: str, stamp: Stamp, now: float, pinned: bool = False, boot: str = "") -> None:
        """Record a verified chunk; `boot` names the boot it was written in when it was not fsynced."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO chunks (digest, size, ino, mtime_ns, ctime_ns, used, pinned, boot) "
                "VALUES (?,?,?,?,?,?,?,?) "
                "ON CONFLICT(digest) DO UPDATE SET size=excluded.size, ino=excluded.ino, mtime_ns=excluded.mtime_ns, "
                "ctime_ns=excluded.ctime_ns, used=excluded.used, pinned=MAX(pinned, excluded.pinned), "
                "boot=excluded.boot",
                (digest, stamp.size, stamp.ino, stamp.mtime_ns, stamp.ctime_ns, now, int(pinned), boot),
            )

    def delete(self, digests: Iterable[str]) -> None:
        with self._tx() as db:
            db.executemany("DELETE FROM chunks WHERE digest = ?", [(d,) for d in digests])

    def touch(self, digests: Iterable[str], now: float) -> None:
        """Mark chunks used at `now`: one statement per 900 digests, no transaction at all for none."""
        wanted = list(digests)
        if not wanted:
            return
        with self._tx() as db:
            for i in range(0, len(wanted), 900):
                part = wanted[i : i + 900]
                db.execute(f"UPDATE chunks SET used = ? WHERE digest IN ({','.join('?' * len(part))})", [now, *part])

    def used_bytes(self) -> tuple[int, int]:
        with self._tx() as db:
            count, total = db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM chunks").fetchone()
        return int(count), int(total)

    def evict_candidates(self, protect: set[str], evict_pinned: bool) -> Iterator[tuple[str, int]]:
        """Least recently used first."""
        where = "" if evict_pinned else "WHERE pinned = 0"
        with self._tx() as db:
            found = db.execute(f"SELECT digest, size FROM chunks {where} ORDER BY used ASC").fetchall()
        return ((d, s) for d, s in found if d not in protect)

    def bump(self, counter: str, by: int = 1) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO counters (name, value) VALUES (?, ?) "
                "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
                (counter, by),
            )

    def counter(self, counter: str) -> int:
        with self._tx() as db:
            row = db.execute("SELECT value FROM counters WHERE name = ?", (counter,)).fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        with self._lock:
            self._db.close()
