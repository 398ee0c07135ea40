"""The durable job store: requests that found no capacity wait here, in one SQLite file.

A job is queued -> running -> succeeded | failed. Workers `claim_next` atomically (one
`BEGIN IMMEDIATE` transaction, so two threads or two processes never claim the same job),
oldest first. After a restart `requeue_running` puts jobs that were running back in the
queue, so nothing accepted is lost. Finished jobs keep their result for `result_ttl_s`
after they finish, however often it is fetched (a client whose poll response was lost can
poll again); `get` already answers JobNotFound past the TTL, and `expire` deletes them.

Tensors are stored as one blob: a 4-byte little-endian header length, a JSON header
listing each tensor's name, datatype, shape and byte count, then the tensors' raw bytes
(`ember.wire.tensors.to_raw`). Wall-clock times come from the injected `wall()`.
"""

from __future__ import annotations

import json
import os
import sqlite3
import struct
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ember.errors import InvalidInput, JobNotFound, Overloaded, StoreError
from ember.serving.results import JobStatus
from ember.wire.tensors import Tensors, datatype_of, from_raw, to_raw

__all__ = ["ClaimedJob", "JobStatus", "JobStore", "JobStoreError", "decode_tensors", "encode_tensors"]

DB_NAME = "jobs.sqlite3"

_SCHEMA = """
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
    finished_at REAL
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, seq);
"""


class JobStoreError(StoreError):
    """The job database failed (disk full, corrupt file, locked too long, ...)."""


@dataclass  # not frozen: it satisfies protocols that declare plain (settable) attributes
class ClaimedJob:
    id: str
    model: str
    version: str
    inputs: Tensors


def encode_tensors(tensors: Tensors) -> bytes:
    raws = [to_raw(a) for a in tensors.values()]
    header = [{"name": n, "datatype": datatype_of(a), "shape": list(a.shape), "nbytes": len(r)}
              for (n, a), r in zip(tensors.items(), raws, strict=True)]
    head = json.dumps(header).encode()
    return struct.pack("<I", len(head)) + head + b"".join(raws)


def decode_tensors(blob: bytes) -> Tensors:
    (n,) = struct.unpack_from("<I", blob, 0)
    header = json.loads(blob[4 : 4 + n])
    view = memoryview(blob)
    offset = 4 + n
    out: Tensors = {}
    for t in header:
        out[t["name"]] = from_raw(view[offset : offset + t["nbytes"]], t["datatype"], tuple(t["shape"]), t["name"])
        offset += t["nbytes"]
    return out


class JobStore:
    """Jobs in one SQLite file (WAL mode). Thread-safe; several processes may share the file."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_queued: int,
        result_ttl_s: float,
        wall: Callable[[], float] = time.time,
        retry_after_s: float = 5.0,
    ) -> None:
        if max_queued < 1:
            raise InvalidInput(f"max_queued: must be at least 1, got {max_queued}")
        if result_ttl_s <= 0:
            raise InvalidInput(f"result_ttl_s: must be positive, got {result_ttl_s}")
        path = Path(path)
        self.path = path / DB_NAME if path.is_dir() else path
        self.max_queued = max_queued
        self.result_ttl_s = result_ttl_s
        self.retry_after_s = retry_after_s
        self._wall = wall
        self._lock = threading.Lock()
        self._conn = self._open()

    def _open(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # The jobs hold clients' inputs and outputs: the file is the server's alone (SQLite gives its
            # -wal and -shm files the same mode).
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
            for path in (self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")):
                if path.exists():
                    path.chmod(0o600)
            conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")  # an accepted (202) job must survive power loss
            conn.executescript(_SCHEMA)
        except (sqlite3.Error, OSError) as err:
            raise JobStoreError(f"job store {str(self.path)!r}: cannot open: {err}") from None
        return conn

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self, what: str) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken up front so concurrent writers queue instead of deadlocking."""
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    yield self._conn
                    self._conn.execute("COMMIT")
                except BaseException:
                    # Also when COMMIT fails: a transaction left open would refuse every later BEGIN.
                    if self._conn.in_transaction:
                        self._conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as err:
                raise JobStoreError(f"job store {str(self.path)!r}: {what} failed: {err}") from None

    @contextmanager
    def _read(self, what: str) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._conn
            except sqlite3.Error as err:
                raise JobStoreError(f"job store {str(self.path)!r}: {what} failed: {err}") from None

    def _decode(self, blob: bytes, job_id: str) -> Tensors:
        try:
            return decode_tensors(blob)
        except (ValueError, KeyError, TypeError, struct.error, InvalidInput) as err:
            raise JobStoreError(f"job store {str(self.path)!r}: job {job_id} holds unreadable tensors: {err}") from None

    def submit(self, model: str, version: str, inputs: Tensors) -> str:
        """Queue a job; Overloaded when max_queued jobs are already waiting."""
        job_id = uuid.uuid4().hex
        blob = encode_tensors(inputs)
        with self._tx("submit") as db:
            (queued,) = db.execute("SELECT COUNT(*) FROM jobs WHERE state = 'queued'").fetchone()
            if queued >= self.max_queued:
                raise Overloaded(f"job queue full: {queued} jobs waiting (max_queued {self.max_queued})",
                                 retry_after=self.retry_after_s)
            db.execute("INSERT INTO jobs (id, model, version, state, inputs, created_at) "
                       "VALUES (?, ?, ?, 'queued', ?, ?)", (job_id, model, version, blob, self._wall()))
        return job_id

    def claim_next(self, models: Collection[str] | None = None) -> ClaimedJob | None:
        """The oldest queued job, now running; None when there is none."""
        claimed = self.claim(models, 1)
        return claimed[0] if claimed else None

    def claim(self, models: Collection[str] | None = None, limit: int = 1) -> list[ClaimedJob]:
        """Up to `limit` of the oldest queued jobs, now running, in one transaction (one fsync for all).

        `models` (when given) limits the claim to those models; each entry is a model name
        or a "name:version" key.
        """
        where, args = "state = 'queued'", []
        if models is not None:
            if not models:
                return []
            args = list(models)
            marks = ",".join("?" * len(args))
            where += f" AND (model IN ({marks}) OR model || ':' || version IN ({marks}))"
            args = args + args
        query = f"SELECT id, model, version, inputs FROM jobs WHERE {where} ORDER BY seq LIMIT ?"
        claimed: list[ClaimedJob] = []
        with self._tx("claim") as db:
            while len(claimed) < limit:
                rows = db.execute(query, [*args, limit - len(claimed)]).fetchall()
                if not rows:
                    break
                for job_id, model, version, blob in rows:
                    try:
                        inputs = self._decode(blob, job_id)
                    except JobStoreError as err:
                        # Fail it here: claimed as running, it would never finish (and come back at each restart).
                        db.execute("UPDATE jobs SET state = 'failed', error = ?, finished_at = ?, inputs = x'' "
                                   "WHERE id = ?", (err.message, self._wall(), job_id))
                        continue
                    db.execute("UPDATE jobs SET state = 'running' WHERE id = ?", (job_id,))
                    claimed.append(ClaimedJob(id=job_id, model=model, version=version, inputs=inputs))
        return claimed

    def complete(self, job_id: str, outputs: Tensors) -> None:
        self._finish(job_id, "succeeded", encode_tensors(outputs), None)

    def fail(self, job_id: str, message: str) -> None:
        self._finish(job_id, "failed", None, message)

    def _finish(self, job_id: str, state: str, outputs: bytes | None, error: str | None) -> None:
        with self._tx(state) as db:
            cur = db.execute("UPDATE jobs SET state = ?, outputs = ?, error = ?, finished_at = ?, inputs = x'' "
                             "WHERE id = ? AND state = 'running'", (state, outputs, error, self._wall(), job_id))
            if cur.rowcount == 0:
                raise JobNotFound(f"job {job_id}: no such running job")

    def requeue(self, job_id: str) -> None:
        """A running job back to the queue, keeping its place (e.g. its worker crashed)."""
        with self._tx("requeue") as db:
            cur = db.execute("UPDATE jobs SET state = 'queued' WHERE id = ? AND state = 'running'", (job_id,))
            if cur.rowcount == 0:
                raise JobNotFound(f"job {job_id}: no such running job")

    def fail_queued(self, model: str, version: str | None, message: str) -> int:
        """Fail every queued job of a model (all versions when `version` is None); returns how many.

        For a model that is gone (unloaded, or no longer in the repository): its jobs would
        otherwise wait forever and hold places in the bounded queue.
        """
        sql = "UPDATE jobs SET state = 'failed', error = ?, finished_at = ?, inputs = x'' " \
              "WHERE state = 'queued' AND model = ?"
        args: tuple[object, ...] = (message, self._wall(), model)
        if version is not None:
            sql, args = sql + " AND version = ?", (*args, version)
        with self._tx("fail_queued") as db:
            return db.execute(sql, args).rowcount

    def queued_models(self) -> set[tuple[str, str]]:
        """(model, version) of every queued job."""
        with self._read("queued_models") as db:
            return {(m, v) for m, v in db.execute("SELECT DISTINCT model, version FROM jobs WHERE state = 'queued'")}

    def requeue_running(self) -> int:
        """On restart: every running job back to the queue. Returns how many."""
        with self._tx("requeue_running") as db:
            return db.execute("UPDATE jobs SET state = 'queued' WHERE state = 'running'").rowcount

    def get(self, job_id: str) -> JobStatus:
        with self._read("get") as db:
            row = db.execute("SELECT model, version, state, outputs, error, created_at, finished_at "
                             "FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None or (row[6] is not None and row[6] + self.result_ttl_s <= self._wall()):
            raise JobNotFound(f"job {job_id}: no such job (never submitted, or its result expired)")
        model, version, state, outputs, error, created, finished = row
        return JobStatus(job_id=job_id, model=model, version=version, state=state, created_at=created,
                         finished_at=finished, outputs=self._decode(outputs, job_id) if outputs is not None else None,
                         error=error)

    def expire(self) -> int:
        """Delete finished jobs whose result outlived the TTL. Returns how many."""
        with self._tx("expire") as db:
            return db.execute("DELETE FROM jobs WHERE finished_at IS NOT NULL AND finished_at <= ?",
                              (self._wall() - self.result_ttl_s,)).rowcount

    def queued_stats(self) -> dict[tuple[str, str], tuple[int, float]]:
        """Per (model, version): queued jobs and the age in seconds of the oldest."""
        now = self._wall()
        with self._read("stats") as db:
            rows = db.execute("SELECT model, version, COUNT(*), MIN(created_at) FROM jobs WHERE state = 'queued' "
                              "GROUP BY model, version").fetchall()
        return {(m, v): (int(n), max(0.0, now - float(oldest))) for m, v, n, oldest in rows}

    def queued_count(self, model: str | None = None) -> int:
        sql = "SELECT COUNT(*) FROM jobs WHERE state = 'queued'"
        args: tuple[str, ...] = ()
        if model is not None:
            sql, args = sql + " AND model = ?", (model,)
        with self._read("count") as db:
            return int(db.execute(sql, args).fetchone()[0])
