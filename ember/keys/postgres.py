"""A cluster's API keys in its shared job database (`--jobs-url postgresql://...`): table `ember_api_keys`.

One row per key: its id, tenant, role, the SHA-256 of the whole key (never the key) and its dates; a revoked
key keeps its row with `revoked_at` set. `ember keys --jobs-url URL create|list|revoke` write it, and every node
serving with that URL reads it (`ember.keys.store.SharedKeyRing`, every second). The table is created on first use
(under a transaction-scoped advisory lock, so nodes starting together do not race). Every failure raises
`KeyFileError` (a StoreError) whose message names no host or password.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from ember.core.access import Role
from ember.errors import InvalidInput
from ember.jobs.postgres import redacted
from ember.keys.store import KeyFileError, KeyRecord, new_key

TABLE = "ember_api_keys"
_SCHEMA_LOCK = 0x656D62657202   # b"ember" + 2 (ember/jobs/postgres.py holds 0 and 1)
SCHEMA = (f"CREATE TABLE IF NOT EXISTS {TABLE} (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, "
          f"role TEXT NOT NULL CHECK (role IN ('admin', 'user')), sha256 TEXT NOT NULL, "
          f"created_at DOUBLE PRECISION NOT NULL, revoked_at DOUBLE PRECISION)")
_COLUMNS = "id, tenant, role, sha256, created_at, revoked_at"


class PgKeys:
    """Implements `ember.keys.store.KeyStore` over one connection (reopened after a failure). Thread-safe."""

    def __init__(self, url: str, *, wall: Callable[[], float] = time.time, connect_timeout_s: int = 5) -> None:
        self.url, self.where = url, redacted(url)
        self._wall, self._connect_timeout_s = wall, connect_timeout_s
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        conn = psycopg.connect(self.url, autocommit=True, connect_timeout=self._connect_timeout_s,
                               application_name="ember-keys")
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            conn.execute(SCHEMA)
        self._conn = conn
        return conn

    def _run(self, what: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                cur = self._connection().execute(sql, params)
                return cur.fetchall() if cur.description is not None else []
            except psycopg.Error as err:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                reason = "cannot reach the database server" if isinstance(err, psycopg.OperationalError) \
                    and not err.sqlstate else (err.diag.message_primary or type(err).__name__)
                raise KeyFileError(f"API keys in {self.where}: {what} failed: {reason}") from None

    def records(self) -> list[KeyRecord]:
        rows = self._run("read", f"SELECT {_COLUMNS} FROM {TABLE} ORDER BY created_at, id")
        return [KeyRecord(id=r[0], tenant=r[1], role=r[2], sha256=r[3], created_at=r[4], revoked_at=r[5])
                for r in rows]

    def create(self, tenant: str, role: Role) -> tuple[KeyRecord, str]:
        taken = {r[0] for r in self._run("read", f"SELECT id FROM {TABLE}")}
        record, key = new_key(tenant, role, taken, self._wall())
        self._run("create", f"INSERT INTO {TABLE} ({_COLUMNS}) VALUES (%s, %s, %s, %s, %s, NULL)",
                  (record.id, record.tenant, record.role, record.sha256, record.created_at))
        return record, key

    def revoke(self, key_id: str) -> KeyRecord:
        rows = self._run("revoke", f"UPDATE {TABLE} SET revoked_at = %s WHERE id = %s AND revoked_at IS NULL "
                                   f"RETURNING {_COLUMNS}", (self._wall(), key_id))
        if not rows:
            raise InvalidInput(f"ID: no active key with id {key_id!r} in {self.where} (see `ember keys list`)")
        r = rows[0]
        return KeyRecord(id=r[0], tenant=r[1], role=r[2], sha256=r[3], created_at=r[4], revoked_at=r[5])

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
