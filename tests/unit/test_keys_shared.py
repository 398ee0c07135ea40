"""A cluster's keys on a node (`SharedKeyRing`): read again every refresh, the last read kept while the store is
away; `KeyRings`: a node's file and the cluster's store together. The store here is a real `KeyFile` (the
PostgreSQL one: tests/integration/jobs/test_keys_pg.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ember.core.access import Principal
from ember.keys.store import KeyFile, KeyFileError, KeyRecord, KeyRing, KeyRings, SharedKeyRing


class Unreadable:
    """A store that fails while `away`, else reads `inner`."""

    def __init__(self, inner: KeyFile) -> None:
        self.inner, self.away = inner, False

    def records(self) -> list[KeyRecord]:
        if self.away:
            raise KeyFileError("API keys: cannot reach the database server")
        return self.inner.records()

    def create(self, tenant: str, role: str) -> tuple[KeyRecord, str]:
        raise NotImplementedError

    def revoke(self, key_id: str) -> KeyRecord:
        raise NotImplementedError


def _until(predicate: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():   # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_key_created_or_revoked_in_the_store_is_seen_at_the_next_refresh(tmp_path: Path) -> None:
    store = KeyFile(tmp_path / "keys.json")
    ring = SharedKeyRing(store, "test", refresh_s=0.05)
    try:
        record, key = store.create("acme", "admin")
        assert ring.authenticate(key) is None or ring.reads > 1   # not before a refresh has read it
        _until(lambda: ring.authenticate(key) == Principal("acme", "admin", record.id))
        assert ring.active() == 1 and ring.authenticate(key + "x") is None
        store.revoke(record.id)
        _until(lambda: ring.authenticate(key) is None)
    finally:
        ring.close()


def test_the_store_away_keeps_the_keys_read_last_and_logs_once(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    store = KeyFile(tmp_path / "keys.json")
    _, key = store.create("acme", "user")
    flaky = Unreadable(store)
    ring = SharedKeyRing(flaky, "the job database", refresh_s=3600)   # refreshed by hand below
    try:
        flaky.away = True
        ring.refresh()
        ring.refresh()
        assert ring.authenticate(key) is not None
        assert [r.message for r in caplog.records].count(
            "API keys: cannot read the job database (API keys: cannot reach the database server); keeping the 1 "
            "keys read last until it can") == 1
        flaky.away = False
        store.revoke(store.records()[0].id)
        ring.refresh()
        assert ring.authenticate(key) is None
    finally:
        ring.close()


def test_a_key_of_the_nodes_file_or_of_the_cluster_is_valid(tmp_path: Path) -> None:
    local, cluster = KeyFile(tmp_path / "node" / "keys.json"), KeyFile(tmp_path / "cluster.json")
    _, node_key = local.create("ops", "admin")
    _, cluster_key = cluster.create("acme", "user")
    shared = SharedKeyRing(cluster, "cluster", refresh_s=3600)
    rings = KeyRings([KeyRing(local.path), shared])
    try:
        assert rings.authenticate(node_key) == Principal("ops", "admin", node_key.split("_")[1])
        assert rings.authenticate(cluster_key) == Principal("acme", "user", cluster_key.split("_")[1])
        assert rings.authenticate("ember_000000000000_" + "x" * 43) is None
        assert rings.active() == 2
    finally:
        rings.close()
