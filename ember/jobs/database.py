"""Opening the job database: a private file, checked before use, moved aside when damaged.

SQLite opens a damaged file without complaint and fails later, one statement at a time: a
server on such a file would report ready and accept 202 jobs that never run. So before any
write the file is checked: a zero-length file (its queue is gone), a header that is not
SQLite's, `PRAGMA quick_check` errors, or a file without the jobs table are all "damaged".
A damaged file (with its -wal and -shm) is renamed with a UTC timestamp suffix and kept for
forensics, one ERROR line says where it went and how many jobs it held (when they could be
counted), and a fresh database takes over. Errors that say nothing about the file's content
(locked, I/O error, disk full, permission denied) move nothing: they are raised, and the
caller retries later.

The file is created 0600 (jobs hold clients' inputs and outputs) and tightened to 0600 when
it exists; SQLite gives the -wal and -shm files it creates the database file's mode.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from ember.jobs.wal import check_wal, keep_copy

log = logging.getLogger("ember.jobs")

__all__ = ["SCHEMA", "open_db"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    model TEXT NOT NULL,
    version TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('queued', 'running', 'succeeded', 'failed')),
    inputs BLOB NOT NULL,
    outputs BLOB,
    error TEXT,
    created_at REAL NOT NULL,
    finished_at REAL,
    claimed_by TEXT,
    claimed_at REAL,
    idem_key TEXT,
    fingerprint TEXT,
    tenant TEXT
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, seq);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_by_key ON jobs (model, version, idem_key) WHERE idem_key IS NOT NULL;
"""

_BASE_COLUMNS = {"seq", "id", "model", "version", "state", "inputs", "outputs", "error", "created_at", "finished_at"}
# Added since the first schema: an older file gets them with ALTER TABLE (NULL in old rows).
_ADDED_COLUMNS = {"claimed_by": "TEXT", "claimed_at": "REAL", "idem_key": "TEXT", "fingerprint": "TEXT",
                  "tenant": "TEXT"}
# What a file's content (not the machine) is to blame for.
_DAMAGE_CODES = {sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB}
_SIDE_FILES = ("-wal", "-shm")


class _Damaged(Exception):
    def __init__(self, reason: str, conn: sqlite3.Connection | None = None) -> None:
        super().__init__(reason)
        self.reason, self.conn = reason, conn


def open_db(path: Path, wall: Callable[[], float], timeout_s: float = 10.0,
            damaged: Callable[[str], None] | None = None) -> sqlite3.Connection:
    """The checked database at `path` (created if absent). Raises sqlite3.Error or OSError when it cannot be
    opened for reasons other than damage (those are the caller's to translate and retry). `damaged` hears of
    damage found (a bad WAL, a file moved aside), in the words of the ERROR line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and (wal_damage := check_wal(path)) is not None:
        kept = keep_copy(path, wall())
        good = wal_damage.good_frames
        message = f"job store {path}: {wal_damage.describe()}. The WAL was copied to {kept}; " \
                  + (f"SQLite replays its {good} good frame(s)." if good else "nothing in it can be replayed.")
        log.error("%s", message)
        if damaged is not None:
            damaged(message)
    try:
        return _open_checked(path, timeout_s)
    except _Damaged as damage:
        held = _count_jobs(damage.conn)
        if damage.conn is not None:
            damage.conn.close()
        dest = _move_aside(path, wall())
        message = f"job store {path} is damaged ({damage.reason}): moved aside to {dest}; {held}. A fresh job " \
                  "store takes over."
        log.error("%s", message)
        if damaged is not None:
            damaged(message)
    return _open_checked(path, timeout_s)


def _open_checked(path: Path, timeout_s: float) -> sqlite3.Connection:
    existed = path.exists()
    if existed and path.stat().st_size == 0:
        raise _Damaged("the file is empty (zero bytes): whatever it held is lost")
    _private(path)
    wal = _wal_before(path)   # before SQLite opens (and may create) it
    conn = sqlite3.connect(path, timeout=timeout_s, isolation_level=None, check_same_thread=False)
    try:
        if existed:
            _check(conn, path, wal)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")  # an accepted (202) job must survive power loss
        conn.executescript(SCHEMA)
        for name in ("-wal", "-shm"):
            _private(path.with_name(path.name + name), create=False)
    except _Damaged:
        raise   # with the connection open: what it held is counted before it is moved aside
    except sqlite3.DatabaseError as err:
        if err.sqlite_errorcode in _DAMAGE_CODES:
            raise _Damaged(str(err), conn) from None
        conn.close()
        raise
    except BaseException:
        conn.close()
        raise
    return conn


def _wal_before(path: Path) -> str:
    """The WAL as it was found, in the words of a damage report."""
    try:
        size = path.with_name(path.name + "-wal").stat().st_size
    except FileNotFoundError:
        return "missing"
    return "empty (zero bytes)" if size == 0 else f"{size} bytes that SQLite did not replay"


def _check(conn: sqlite3.Connection, path: Path, wal: str) -> None:
    """Raises _Damaged unless the file passes quick_check and holds the jobs table (old columns are added)."""
    problems = [row[0] for row in conn.execute("PRAGMA quick_check(5)").fetchall()]
    if problems != ["ok"]:
        raise _Damaged("quick_check: " + "; ".join(problems), conn)
    columns = {row[1] for row in conn.execute("PRAGMA table_info(jobs)").fetchall()}
    if not columns:
        raise _Damaged(_no_jobs_table(conn, path, wal), conn)
    if missing := _BASE_COLUMNS - columns:
        raise _Damaged(f"the jobs table lacks {', '.join(sorted(missing))}", conn)
    for name, kind in _ADDED_COLUMNS.items():
        if name not in columns:
            conn.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")


def _no_jobs_table(conn: sqlite3.Connection, path: Path, wal: str) -> str:
    """Why the file lacks the jobs table, as far as it says: a database in WAL mode that holds no table at all
    had everything written to it in its WAL (nothing was ever checkpointed), and that WAL is gone."""
    tables = conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0]
    with path.open("rb") as f:
        in_wal_mode = f.read(20)[18:20] == b"\x02\x02"   # the file format's write and read versions
    if tables == 0 and in_wal_mode:
        return f"no jobs table: the file holds no table and is in WAL mode, so everything written to it was in its " \
               f"WAL, which is {wal}: the jobs table and its jobs are lost"
    return "no jobs table: not ember's job database, or its schema is gone"


def _count_jobs(conn: sqlite3.Connection | None) -> str:
    """What the damaged file held, as far as it can still be read."""
    if conn is None:
        return "its jobs could not be counted"
    try:
        rows = conn.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state ORDER BY state").fetchall()
    except sqlite3.Error:
        return "its jobs could not be counted"
    total = sum(n for _, n in rows)
    detail = ", ".join(f"{n} {state}" for state, n in rows)
    return f"it held {total} job(s)" + (f" ({detail}); unfinished ones will not run" if total else "")


def _move_aside(path: Path, now: float) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    dest, n = path.with_name(f"{path.name}.damaged-{stamp}"), 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    # The side files keep the main file's new name as their prefix, so SQLite opens the three together.
    for suffix in _SIDE_FILES:
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.rename(dest.with_name(dest.name + suffix))
    path.rename(dest)
    return dest


def _private(path: Path, create: bool = True) -> None:
    """Owner-only: created 0600 (before SQLite creates it with the umask's mode), or tightened to 0600."""
    if create and not path.exists():
        os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    if path.exists() and path.stat().st_mode & 0o777 != 0o600:
        path.chmod(0o600)
