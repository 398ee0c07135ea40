"""The durable job store: requests that found no capacity wait here, in one SQLite file.

A job is queued -> running -> succeeded | failed. Workers `claim` atomically (one
`BEGIN IMMEDIATE` transaction, so two threads or two processes never claim the same job),
oldest first. A claim is a lease: the job records who claimed it (`owner`) and when; the
worker `renew`s the jobs it still runs, and `reclaim_expired` puts a running job whose lease
ran out (its worker is gone) back in the queue; after a restart `requeue_running` does so at
once. So nothing accepted is lost, and delivery is at least once: a job whose worker died
mid-run runs again. A submission may carry an idempotency key: a repeat with the same key for
the same model gets the first job's id back while that job lives (keys expire with its result);
the same key with other inputs is an IdempotencyConflict. Finished jobs keep their result for
`result_ttl_s` after they finish, however often it is fetched (a client whose poll response
was lost can poll again); `get` already answers JobNotFound past the TTL, and `expire`
deletes them.

The store never raises from its constructor on I/O: a file it cannot open (or reopen after a
damaged one was moved aside, see `ember.jobs.database`) is retried by the next call, and every
call that fails raises JobStoreError (a 503 with Retry-After), whose message names no path.

Tensors are stored as one blob, a tensor bundle (`ember.wire.bundle.pack`: a 4-byte little-endian length, a
JSON list of each tensor's name, datatype, shape and byte count, then the tensors' raw bytes). Wall-clock
times come from the injected `wall()`.

A job records the tenant that submitted it (None with authentication off), and the gateway shows it to
that tenant only. A database from before tenants gets the column when it is opened (NULL for old jobs).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from ember.errors import IdempotencyConflict, InvalidInput, JobNotFound, JobStoreError, Overloaded
from ember.jobs.database import open_db
from ember.serving.results import JobStatus
from ember.wire import bundle
from ember.wire.tensors import Tensors

__all__ = ["ClaimedJob", "JobStatus", "JobStore", "JobStoreError"]

DB_NAME = "jobs.sqlite3"
log = logging.getLogger("ember.jobs")


@dataclass  # not frozen: it satisfies protocols that declare plain (settable) attributes
class ClaimedJob:
    id: str
    model: str
    version: str
    inputs: Tensors
    tenant: str | None = None   # who submitted it (None: authentication was off)


def stored_tensors(blob: bytes, job_id: str, retry_after_s: float, where: str) -> Tensors:
    """A job's stored tensors back; JobStoreError (naming no path) when they are unreadable. Shared by the SQLite
    and PostgreSQL stores."""
    try:
        return bundle.unpack(blob, "job")
    except InvalidInput as err:
        raise JobStoreError(f"job store: job {job_id} holds unreadable tensors: {err}", retry_after=retry_after_s,
                            where=where) from None


def scoped_key(idempotency_key: str, tenant: str | None) -> str:
    """The key as stored: scoped by tenant, so one tenant's key never names (or conflicts with) another's job.
    Keys are printable ASCII (the gateway checks), so the newline cannot be forged into a tenant's prefix."""
    return idempotency_key if tenant is None else f"{tenant}\n{idempotency_key}"


def keyed_job(row: tuple[object, object, object], fingerprint: str, model: str, now: float,
              result_ttl_s: float) -> str | None:
    """The job an idempotency key's row (id, fingerprint, finished_at) still names; None once its result expired.
    IdempotencyConflict when the key was used with other inputs. Shared by the SQLite and PostgreSQL stores."""
    job_id, earlier, finished = row
    if finished is not None and float(finished) + result_ttl_s <= now:  # type: ignore[arg-type]
        return None
    if earlier != fingerprint:
        raise IdempotencyConflict(f"Idempotency-Key: already used for job {job_id} of model '{model}' "
                                  f"with other inputs; use a new key for a new request")
    return str(job_id)


class OneConnectionStore:
    """What both job stores share: the bounds they check, the claim owner, one connection under one lock, close.

    A subclass sets `self._conn` in its `_connection()` and closes it through `close()`.
    """

    _conn: Any

    def __init__(self, *, max_queued: int, result_ttl_s: float, wall: Callable[[], float], retry_after_s: float,
                 owner_prefix: str, owner: str | None) -> None:
        if max_queued < 1:
            raise InvalidInput(f"max_queued: must be at least 1, got {max_queued}")
        if result_ttl_s <= 0:
            raise InvalidInput(f"result_ttl_s: must be positive, got {result_ttl_s}")
        self.max_queued, self.result_ttl_s, self.retry_after_s = max_queued, result_ttl_s, retry_after_s
        # Who holds a claim: this process (a lease outlives neither its host nor its pid).
        self.owner = owner or f"{owner_prefix}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._wall = wall
        self._lock = threading.Lock()
        self._closed = False
        self._conn = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class JobStore(OneConnectionStore):
    """Jobs in one SQLite file (WAL mode). Thread-safe; several processes may share the file."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_queued: int,
        result_ttl_s: float,
        wall: Callable[[], float] = time.time,
        retry_after_s: float = 5.0,
        owner: str | None = None,
    ) -> None:
        super().__init__(max_queued=max_queued, result_ttl_s=result_ttl_s, wall=wall, retry_after_s=retry_after_s,
                         owner_prefix=socket.gethostname(), owner=owner)
        path = Path(path)
        self.path = path / DB_NAME if path.is_dir() else path
        self._conn: sqlite3.Connection | None = None
        self.damage: str | None = None   # damage found when the file was opened (a bad WAL, a file moved aside)
        try:
            with self._lock:
                self._connection()
        except JobStoreError as err:
            # Synchronous serving does not need the job store: start without it, the next call retries.
            log.error("job store %s: %s (retried on the next use)", self.path, err.message)

    def _damaged(self, message: str) -> None:
        self.damage = message if self.damage is None else f"{self.damage}; {message}"

    def set_max_bytes(self, max_bytes: int | None) -> None:
        """Bound the file's size (None: unbounded): writes past it fail as on a full disk (SQLITE_FULL).

        A size cap for operators, and an honest full disk for tests."""
        with self._read("set_max_bytes") as db:
            page_size = int(db.execute("PRAGMA page_size").fetchone()[0])
            pages = 4_294_967_294 if max_bytes is None else max(1, max_bytes // page_size)
            db.execute(f"PRAGMA max_page_count = {pages}")

    def _error(self, what: str, err: BaseException) -> JobStoreError:
        reason = (err.strerror or type(err).__name__) if isinstance(err, OSError) else str(err)
        if isinstance(err, sqlite3.DatabaseError) and err.sqlite_errorcode in (sqlite3.SQLITE_CORRUPT,
                                                                                sqlite3.SQLITE_NOTADB):
            reason += " (the file is damaged: restarting ember moves it aside)"
        return JobStoreError(f"job store: {what} failed: {reason}", retry_after=self.retry_after_s,
                             where=str(self.path))

    def _connection(self) -> sqlite3.Connection:
        """The open connection, opening (checking, and if need be replacing) the file first. Under the lock."""
        if self._closed:
            raise JobStoreError("job store: closed", retry_after=self.retry_after_s, where=str(self.path))
        if self._conn is None:
            try:
                self._conn = open_db(self.path, self._wall, damaged=self._damaged)
            except (sqlite3.Error, OSError) as err:
                raise self._error("open", err) from None
        return self._conn

    @contextmanager
    def _tx(self, what: str) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken up front so concurrent writers queue instead of deadlocking."""
        with self._lock:
            conn = self._connection()
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                    conn.execute("COMMIT")
                except BaseException:
                    # Also when COMMIT fails: a transaction left open would refuse every later BEGIN.
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as err:
                raise self._error(what, err) from None

    @contextmanager
    def _read(self, what: str) -> Iterator[sqlite3.Connection]:
        with self._lock:
            conn = self._connection()
            try:
                yield conn
            except sqlite3.Error as err:
                raise self._error(what, err) from None

    def _decode(self, blob: bytes, job_id: str) -> Tensors:
        return stored_tensors(blob, job_id, self.retry_after_s, str(self.path))

    def submit(self, model: str, version: str, inputs: Tensors, tenant: str | None = None,
               idempotency_key: str | None = None) -> str:
        """Queue a job (for `tenant`'s eyes only) and return its id; Overloaded when max_queued jobs are already
        waiting.

        With `idempotency_key`: while a job of this model holds that key (the same tenant's: keys are scoped by
        tenant), its id (no new job); other inputs under the same key raise IdempotencyConflict."""
        job_id = uuid.uuid4().hex
        blob = bundle.pack(inputs)
        fingerprint = hashlib.sha256(blob).hexdigest() if idempotency_key is not None else None
        if idempotency_key is not None:
            idempotency_key = scoped_key(idempotency_key, tenant)
        with self._tx("submit") as db:
            if idempotency_key is not None and fingerprint is not None:
                earlier = self._keyed(db, model, version, idempotency_key, fingerprint)
                if earlier is not None:
                    return earlier
            (queued,) = db.execute("SELECT COUNT(*) FROM jobs WHERE state = 'queued'").fetchone()
            if queued >= self.max_queued:
                raise Overloaded(f"job queue full: {queued} jobs waiting (max_queued {self.max_queued})",
                                 retry_after=self.retry_after_s)
            db.execute("INSERT INTO jobs (id, model, version, state, inputs, created_at, idem_key, fingerprint, "
                       "tenant) VALUES (?, ?, ?, 'queued', ?, ?, ?, ?, ?)",
                       (job_id, model, version, blob, self._wall(), idempotency_key, fingerprint, tenant))
        return job_id

    def existing(self, model: str, version: str, idempotency_key: str, inputs: Tensors,
                 tenant: str | None = None) -> str | None:
        """The live job of this model holding `tenant`'s `idempotency_key`, if any (IdempotencyConflict: other
        inputs)."""
        fingerprint = hashlib.sha256(bundle.pack(inputs)).hexdigest()
        key = scoped_key(idempotency_key, tenant)
        with self._read("idempotency lookup") as db:
            return self._keyed(db, model, version, key, fingerprint, drop_expired=False)

    def _keyed(self, db: sqlite3.Connection, model: str, version: str, key: str, fingerprint: str,
               drop_expired: bool = True) -> str | None:
        row = db.execute("SELECT id, fingerprint, finished_at FROM jobs WHERE model = ? AND version = ? "
                         "AND idem_key = ?", (model, version, key)).fetchone()
        if row is None:
            return None
        job_id = keyed_job(row, fingerprint, model, self._wall(), self.result_ttl_s)
        if job_id is None and drop_expired:   # the key expired with its job's result: free it for a new job
            db.execute("DELETE FROM jobs WHERE id = ?", (row[0],))
        return job_id

    def claim_next(self, models: Collection[str] | None = None) -> ClaimedJob | None:
        """The oldest queued job, now running; None when there is none."""
        claimed = self.claim(models, 1)
        return claimed[0] if claimed else None

    def claim(self, models: Collection[str] | None = None, limit: int = 1) -> list[ClaimedJob]:
        """Up to `limit` of the oldest queued jobs, now running (leased to `owner`), in one transaction.

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
        query = f"SELECT id, model, version, inputs, tenant FROM jobs WHERE {where} ORDER BY seq LIMIT ?"
        claimed: list[ClaimedJob] = []
        with self._tx("claim") as db:
            while len(claimed) < limit:
                rows = db.execute(query, [*args, limit - len(claimed)]).fetchall()
                if not rows:
                    break
                for job_id, model, version, blob, tenant in rows:
                    try:
                        inputs = self._decode(blob, job_id)
                    except JobStoreError as err:
                        # Fail it here: claimed as running, it would never finish (and come back at each restart).
                        db.execute("UPDATE jobs SET state = 'failed', error = ?, finished_at = ?, inputs = x'' "
                                   "WHERE id = ?", (err.message, self._wall(), job_id))
                        continue
                    db.execute("UPDATE jobs SET state = 'running', claimed_by = ?, claimed_at = ? WHERE id = ?",
                               (self.owner, self._wall(), job_id))
                    claimed.append(ClaimedJob(id=job_id, model=model, version=version, inputs=inputs, tenant=tenant))
        return claimed

    def renew(self, job_ids: Collection[str]) -> int:
        """Extend the lease of the running jobs this owner still works on. Returns how many."""
        if not job_ids:
            return 0
        ids = list(job_ids)
        with self._tx("renew") as db:
            return db.execute(f"UPDATE jobs SET claimed_at = ? WHERE state = 'running' AND claimed_by = ? "
                              f"AND id IN ({','.join('?' * len(ids))})", (self._wall(), self.owner, *ids)).rowcount

    def reclaim_expired(self, lease_s: float) -> int:
        """Running jobs whose lease is older than `lease_s` (their worker is gone) back to the queue, keeping
        their place. Returns how many."""
        with self._tx("reclaim") as db:
            return db.execute("UPDATE jobs SET state = 'queued', claimed_by = NULL, claimed_at = NULL "
                              "WHERE state = 'running' AND (claimed_at IS NULL OR claimed_at <= ?)",
                              (self._wall() - lease_s,)).rowcount

    def complete(self, job_id: str, outputs: Tensors) -> None:
        self._finish(job_id, "succeeded", bundle.pack(outputs), None)

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
            cur = db.execute("UPDATE jobs SET state = 'queued', claimed_by = NULL, claimed_at = NULL "
                             "WHERE id = ? AND state = 'running'", (job_id,))
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
            return db.execute("UPDATE jobs SET state = 'queued', claimed_by = NULL, claimed_at = NULL "
                              "WHERE state = 'running'").rowcount

    def get(self, job_id: str) -> JobStatus:
        with self._read("get") as db:
            row = db.execute("SELECT model, version, state, outputs, error, created_at, finished_at, tenant "
                             "FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None or (row[6] is not None and row[6] + self.result_ttl_s <= self._wall()):
            raise JobNotFound.unknown(job_id)
        model, version, state, outputs, error, created, finished, tenant = row
        return JobStatus(job_id=job_id, model=model, version=version, state=state, created_at=created,
                         finished_at=finished, outputs=self._decode(outputs, job_id) if outputs is not None else None,
                         error=error, tenant=tenant)

    def expire(self) -> int:
        """Delete finished jobs whose result outlived the TTL (their idempotency keys with them). Returns how many."""
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
