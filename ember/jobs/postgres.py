"""The shared job store: the same job queue as `ember.jobs.store.JobStore`, in PostgreSQL, so several nodes share it.

`ember serve --jobs-url postgresql://...` selects it; SQLite stays the default on one node. Semantics match
the SQLite store (see its docstring): queued -> running -> succeeded | failed, oldest first; a claim is a
lease (`owner`, renewed by its worker; `reclaim_expired` puts a job whose lease ran out back in its place in
line, whichever node claimed it); idempotency keys; results kept for `result_ttl_s`; Overloaded past
`max_queued` queued jobs, all nodes together. Delivery is at least once: a job whose node died mid-run runs
again on another.

What differs, because several nodes share the table:

- A claim takes up to `limit` queued jobs with `SELECT ... FOR UPDATE SKIP LOCKED` in one transaction, so
  two nodes claiming at once never take the same job and never wait on each other's rows.
- Submissions take a transaction-scoped advisory lock, so the queue bound and the idempotency-key check
  hold across nodes (submissions are serialised; claims, completions and reads are not).
- `requeue_running` (at a server's start) puts back only the jobs claimed by this `node` (the previous
  server on this machine); jobs other live nodes run are theirs until their lease runs out.
- Wall-clock times come from each node's injected `wall()`: nodes' clocks must agree to well within the
  lease (NTP does).

Like the SQLite store, the constructor never raises on I/O (a database that cannot be reached is retried
by the next call), every failing call raises JobStoreError (503 with Retry-After) whose message names no
host or password (`where`, for the logs, is the URL without its password), a lost connection is reopened
on the next call, and a deadlock or serialisation failure is retried. Tensors are stored as the SQLite
store stores them (tensor bundles, `ember.wire.bundle.pack`).
"""

from __future__ import annotations

import hashlib
import logging
import socket
import time
import uuid
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict

from ember.errors import JobNotFound, JobStoreError, Overloaded
from ember.jobs.store import ClaimedJob, OneConnectionStore, keyed_job, scoped_key, stored_tensors
from ember.serving.results import JobStatus
from ember.wire import bundle
from ember.wire.tensors import Tensors

__all__ = ["PgJobStore"]

log = logging.getLogger("ember.jobs")
T = TypeVar("T")
Cursor = psycopg.Cursor[Any]

TABLE = "ember_jobs"
# pg_advisory_xact_lock keys: b"ember" + 0 (schema) / 1 (submissions), as bigints.
_SCHEMA_LOCK, _SUBMIT_LOCK = 0x656D62657200, 0x656D62657201
_RETRIES = 3      # a deadlock or serialisation failure is tried again this many times in all

SCHEMA = (
    f"""CREATE TABLE IF NOT EXISTS {TABLE} (
        seq BIGSERIAL PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        model TEXT NOT NULL,
        version TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('queued', 'running', 'succeeded', 'failed')),
        inputs BYTEA NOT NULL,
        outputs BYTEA,
        error TEXT,
        created_at DOUBLE PRECISION NOT NULL,
        finished_at DOUBLE PRECISION,
        claimed_by TEXT,
        claimed_at DOUBLE PRECISION,
        idem_key TEXT,
        fingerprint TEXT,
        tenant TEXT)""",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_queued ON {TABLE} (seq) WHERE state = 'queued'",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_running ON {TABLE} (claimed_at) WHERE state = 'running'",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_finished ON {TABLE} (finished_at) WHERE finished_at IS NOT NULL",
    f"CREATE UNIQUE INDEX IF NOT EXISTS {TABLE}_by_key ON {TABLE} (model, version, idem_key) "
    f"WHERE idem_key IS NOT NULL",
)


def redacted(url: str) -> str:
    """The database's address without its password (for logs): postgresql://user@host:port/dbname."""
    try:
        parts = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgresql://(unparseable URL)"
    user = f"{parts['user']}@" if parts.get("user") else ""
    port = f":{parts['port']}" if parts.get("port") else ""
    return f"postgresql://{user}{parts.get('host', '')}{port}/{parts.get('dbname', '')}"


class PgJobStore(OneConnectionStore):
    """Jobs in one PostgreSQL table, shared by every node given the same URL. Thread-safe."""

    def __init__(self, url: str, *, max_queued: int, result_ttl_s: float, wall: Callable[[], float] = time.time,
                 retry_after_s: float = 5.0, owner: str | None = None, node: str | None = None,
                 connect_timeout_s: int = 5, lock_timeout_s: float = 10.0) -> None:
        # Who holds a claim: this node (its previous server's claims are requeued at start) and this process.
        self.node = node or socket.gethostname()
        super().__init__(max_queued=max_queued, result_ttl_s=result_ttl_s, wall=wall, retry_after_s=retry_after_s,
                         owner_prefix=self.node, owner=owner)
        self.url, self.where = url, redacted(url)
        self._connect_timeout_s, self._lock_timeout_ms = connect_timeout_s, int(lock_timeout_s * 1000)
        self._conn: psycopg.Connection[Any] | None = None
        try:
            with self._lock:
                self._connection()
        except JobStoreError as err:
            log.error("job store %s: %s (retried on the next use)", self.where, err.message)

    # ----- connection and transactions ---------------------------------------------------

    def _error(self, what: str, err: BaseException) -> JobStoreError:
        if isinstance(err, psycopg.OperationalError) and not err.sqlstate:
            reason = "cannot reach the database server"     # libpq's text names the host: kept for the logs
            log.warning("job store %s: %s", self.where, str(err).strip())
        elif isinstance(err, psycopg.Error) and err.diag.message_primary:
            reason = err.diag.message_primary
        else:
            reason = type(err).__name__
        return JobStoreError(f"job store: {what} failed: {reason}", retry_after=self.retry_after_s,
                             where=self.where)

    def _connection(self) -> psycopg.Connection[Any]:
        """The open connection, connecting (and creating the table) first. Under the lock."""
        if self._closed:
            raise JobStoreError("job store: closed", retry_after=self.retry_after_s, where=self.where)
        if self._conn is not None and not self._conn.closed:
            return self._conn
        try:
            conn = psycopg.connect(self.url, autocommit=True, connect_timeout=self._connect_timeout_s,
                                   application_name="ember")
        except psycopg.Error as err:
            raise self._error("connect", err) from None
        try:
            conn.execute(f"SET lock_timeout = {self._lock_timeout_ms}")  # a stuck lock: 503 and retry, not a hang
            with conn.transaction():
                # Two nodes starting at once would race on CREATE ... IF NOT EXISTS: one at a time.
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                for statement in SCHEMA:
                    conn.execute(statement)   # constant SQL, no user input
        except psycopg.Error as err:
            conn.close()
            raise self._error("open", err) from None
        self._conn = conn
        return conn

    def _run(self, what: str, work: Callable[[Cursor], T]) -> T:
        """`work` in one transaction; a deadlock or serialisation failure runs it again, other errors are
        JobStoreError (a lost connection is dropped: the next call reconnects). EmberErrors roll back."""
        with self._lock:
            for attempt in range(_RETRIES):
                conn = self._connection()
                try:
                    with conn.transaction(), conn.cursor() as cur:
                        return work(cur)
                except (pg_errors.DeadlockDetected, pg_errors.SerializationFailure) as err:
                    if attempt == _RETRIES - 1:
                        raise self._error(what, err) from None
                except psycopg.Error as err:
                    if conn.broken or conn.closed:
                        conn.close()
                        self._conn = None
                    raise self._error(what, err) from None
        raise AssertionError("unreachable")

    def _decode(self, blob: bytes, job_id: str) -> Tensors:
        return stored_tensors(blob, job_id, self.retry_after_s, self.where)

    # ----- submitting ----------------------------------------------------------------------

    def submit(self, model: str, version: str, inputs: Tensors, tenant: str | None = None,
               idempotency_key: str | None = None) -> str:
        """Queue a job and return its id; Overloaded when max_queued jobs already wait (all nodes together).
        With `idempotency_key`: the live job of this model holding it (IdempotencyConflict: other inputs)."""
        job_id, blob = uuid.uuid4().hex, bundle.pack(inputs)
        fingerprint = hashlib.sha256(blob).hexdigest() if idempotency_key is not None else None
        key = None if idempotency_key is None else scoped_key(idempotency_key, tenant)   # keys are per tenant

        def work(cur: Cursor) -> str:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (_SUBMIT_LOCK,))
            if key is not None and fingerprint is not None:
                earlier = self._keyed(cur, model, version, key, fingerprint)
                if earlier is not None:
                    return earlier
            (queued,) = cur.execute(f"SELECT COUNT(*) FROM {TABLE} WHERE state = 'queued'").fetchone() or (0,)
            if queued >= self.max_queued:
                raise Overloaded(f"job queue full: {queued} jobs waiting (max_queued {self.max_queued})",
                                 retry_after=self.retry_after_s)
            cur.execute(f"INSERT INTO {TABLE} (id, model, version, state, inputs, created_at, idem_key, fingerprint, "
                        f"tenant) VALUES (%s, %s, %s, 'queued', %s, %s, %s, %s, %s)",
                        (job_id, model, version, blob, self._wall(), key, fingerprint, tenant))
            return job_id

        return self._run("submit", work)

    def existing(self, model: str, version: str, idempotency_key: str, inputs: Tensors,
                 tenant: str | None = None) -> str | None:
        """The live job of this model holding `tenant`'s `idempotency_key`, if any (IdempotencyConflict: other
        inputs)."""
        fingerprint = hashlib.sha256(bundle.pack(inputs)).hexdigest()
        key = scoped_key(idempotency_key, tenant)
        return self._run("idempotency lookup",
                         lambda cur: self._keyed(cur, model, version, key, fingerprint, drop_expired=False))

    def _keyed(self, cur: Cursor, model: str, version: str, key: str, fingerprint: str,
               drop_expired: bool = True) -> str | None:
        row = cur.execute(f"SELECT id, fingerprint, finished_at FROM {TABLE} WHERE model = %s AND version = %s "
                          f"AND idem_key = %s", (model, version, key)).fetchone()
        if row is None:
            return None
        job_id = keyed_job(row, fingerprint, model, self._wall(), self.result_ttl_s)
        if job_id is None and drop_expired:   # the key expired with its job's result: free it for a new job
            cur.execute(f"DELETE FROM {TABLE} WHERE id = %s", (row[0],))
        return job_id

    # ----- claiming and leases -------------------------------------------------------------

    def claim_next(self, models: Collection[str] | None = None) -> ClaimedJob | None:
        claimed = self.claim(models, 1)
        return claimed[0] if claimed else None

    def claim(self, models: Collection[str] | None = None, limit: int = 1) -> list[ClaimedJob]:
        """Up to `limit` of the oldest queued jobs no other node is claiming, now running (leased to `owner`).

        `models` (when given) limits the claim to those models; each entry is a name or "name:version"."""
        if models is not None and not models:
            return []
        where, args = "state = 'queued'", []
        if models is not None:
            where += " AND (model = ANY(%s) OR model || ':' || version = ANY(%s))"
            args = [list(models), list(models)]
        query = (f"SELECT seq, id, model, version, inputs, tenant FROM {TABLE} WHERE {where} ORDER BY seq LIMIT %s "
                 f"FOR UPDATE SKIP LOCKED")

        def work(cur: Cursor) -> list[ClaimedJob]:
            claimed: list[tuple[int, ClaimedJob]] = []
            while len(claimed) < limit:
                rows = cur.execute(query, [*args, limit - len(claimed)]).fetchall()
                if not rows:
                    break
                batch: list[tuple[int, ClaimedJob]] = []
                for seq, job_id, model, version, blob, tenant in rows:
                    try:
                        inputs = self._decode(bytes(blob), job_id)
                        batch.append((seq, ClaimedJob(job_id, model, version, inputs, tenant)))
                    except JobStoreError as err:
                        # Fail it here: claimed as running, it would never finish (and come back at each restart).
                        cur.execute(f"UPDATE {TABLE} SET state = 'failed', error = %s, finished_at = %s, "
                                    f"inputs = ''::bytea WHERE seq = %s", (err.message, self._wall(), seq))
                cur.execute(f"UPDATE {TABLE} SET state = 'running', claimed_by = %s, claimed_at = %s "
                            f"WHERE seq = ANY(%s)", (self.owner, self._wall(), [seq for seq, _ in batch]))
                claimed += batch
            return [job for _, job in sorted(claimed, key=lambda c: c[0])]

        return self._run("claim", work)

    def renew(self, job_ids: Collection[str]) -> int:
        """Extend the lease of the running jobs this owner still works on. Returns how many."""
        if not job_ids:
            return 0
        return self._run("renew", lambda cur: cur.execute(
            f"UPDATE {TABLE} SET claimed_at = %s WHERE state = 'running' AND claimed_by = %s AND id = ANY(%s)",
            (self._wall(), self.owner, list(job_ids))).rowcount)

    def reclaim_expired(self, lease_s: float) -> int:
        """Running jobs (any node's) whose lease is older than `lease_s` back to the queue, keeping their place."""
        return self._run("reclaim", lambda cur: cur.execute(
            f"UPDATE {TABLE} SET state = 'queued', claimed_by = NULL, claimed_at = NULL "
            f"WHERE state = 'running' AND (claimed_at IS NULL OR claimed_at <= %s)",
            (self._wall() - lease_s,)).rowcount)

    def requeue_running(self) -> int:
        """On restart: the jobs this node's previous server left running back to the queue. Returns how many.

        Only this node's: the others' belong to live servers (their leases bring back those of dead ones)."""
        return self._run("requeue_running", lambda cur: cur.execute(
            f"UPDATE {TABLE} SET state = 'queued', claimed_by = NULL, claimed_at = NULL "
            f"WHERE state = 'running' AND starts_with(claimed_by, %s)", (self.node + ":",)).rowcount)

    # ----- settling --------------------------------------------------------------------------

    def complete(self, job_id: str, outputs: Tensors) -> None:
        self._finish(job_id, "succeeded", bundle.pack(outputs), None)

    def fail(self, job_id: str, message: str) -> None:
        self._finish(job_id, "failed", None, message)

    def _finish(self, job_id: str, state: str, outputs: bytes | None, error: str | None) -> None:
        def work(cur: Cursor) -> None:
            cur.execute(f"UPDATE {TABLE} SET state = %s, outputs = %s, error = %s, finished_at = %s, "
                        f"inputs = ''::bytea WHERE id = %s AND state = 'running'",
                        (state, outputs, error, self._wall(), job_id))
            if cur.rowcount == 0:
                raise JobNotFound(f"job {job_id}: no such running job")

        self._run(state, work)

    def requeue(self, job_id: str) -> None:
        """A running job back to the queue, keeping its place (e.g. its worker crashed)."""
        def work(cur: Cursor) -> None:
            cur.execute(f"UPDATE {TABLE} SET state = 'queued', claimed_by = NULL, claimed_at = NULL "
                        f"WHERE id = %s AND state = 'running'", (job_id,))
            if cur.rowcount == 0:
                raise JobNotFound(f"job {job_id}: no such running job")

        self._run("requeue", work)

    def fail_queued(self, model: str, version: str | None, message: str) -> int:
        """Fail every queued job of a model (all versions when `version` is None); returns how many."""
        sql = (f"UPDATE {TABLE} SET state = 'failed', error = %s, finished_at = %s, inputs = ''::bytea "
               f"WHERE state = 'queued' AND model = %s")
        args: tuple[object, ...] = (message, self._wall(), model)
        if version is not None:
            sql, args = sql + " AND version = %s", (*args, version)
        return self._run("fail_queued", lambda cur: cur.execute(sql, args).rowcount)

    def expire(self) -> int:
        """Delete finished jobs whose result outlived the TTL (their idempotency keys with them). Returns how many."""
        return self._run("expire", lambda cur: cur.execute(
            f"DELETE FROM {TABLE} WHERE finished_at IS NOT NULL AND finished_at <= %s",
            (self._wall() - self.result_ttl_s,)).rowcount)

    # ----- reading ---------------------------------------------------------------------------

    def get(self, job_id: str) -> JobStatus:
        row = self._run("get", lambda cur: cur.execute(
            f"SELECT model, version, state, outputs, error, created_at, finished_at, tenant FROM {TABLE} "
            f"WHERE id = %s", (job_id,)).fetchone())
        if row is None or (row[6] is not None and row[6] + self.result_ttl_s <= self._wall()):
            raise JobNotFound.unknown(job_id)
        model, version, state, outputs, error, created, finished, tenant = row
        return JobStatus(job_id=job_id, model=model, version=version, state=state, created_at=created,
                         finished_at=finished, error=error, tenant=tenant,
                         outputs=self._decode(bytes(outputs), job_id) if outputs is not None else None)

    def queued_models(self) -> set[tuple[str, str]]:
        rows = self._run("queued_models", lambda cur: cur.execute(
            f"SELECT DISTINCT model, version FROM {TABLE} WHERE state = 'queued'").fetchall())
        return {(m, v) for m, v in rows}

    def queued_stats(self) -> dict[tuple[str, str], tuple[int, float]]:
        """Per (model, version): queued jobs and the age in seconds of the oldest."""
        rows = self._run("stats", lambda cur: cur.execute(
            f"SELECT model, version, COUNT(*), MIN(created_at) FROM {TABLE} WHERE state = 'queued' "
            f"GROUP BY model, version").fetchall())
        now = self._wall()
        return {(m, v): (int(n), max(0.0, now - float(oldest))) for m, v, n, oldest in rows}

    def queued_count(self, model: str | None = None) -> int:
        sql = f"SELECT COUNT(*) FROM {TABLE} WHERE state = 'queued'"
        args: tuple[str, ...] = ()
        if model is not None:
            sql, args = sql + " AND model = %s", (model,)
        row = self._run("count", lambda cur: cur.execute(sql, args).fetchone())
        return int(row[0]) if row else 0
