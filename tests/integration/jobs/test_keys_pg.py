"""A cluster's API keys in the shared job database (ember/keys/postgres.py) against a real PostgreSQL server: what
`ember keys --jobs-url` writes, two nodes' rings read (a key made through one store seen by another's ring,
revoked likewise), and the database away answered as a KeyFileError naming no password."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ember.cli import main
from ember.core.access import Principal
from ember.errors import InvalidInput
from ember.keys.postgres import PgKeys
from ember.keys.store import KeyFileError, SharedKeyRing
from ember.testing.postgres import PostgresServer


def _until(predicate: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():   # type: ignore[operator]
        assert time.monotonic() < deadline, "not within 5 s"
        time.sleep(0.02)


def test_a_key_made_by_one_node_works_on_another_and_a_revoked_one_nowhere(pg_server: PostgresServer) -> None:
    url = pg_server.create_database("keys_two_nodes")
    writer, a_store, b_store = PgKeys(url), PgKeys(url), PgKeys(url)
    a, b = SharedKeyRing(a_store, "a", refresh_s=0.1), SharedKeyRing(b_store, "b", refresh_s=0.1)
    try:
        record, key = writer.create("acme", "user")
        _until(lambda: a.authenticate(key) == b.authenticate(key) == Principal("acme", "user", record.id))
        assert [r.id for r in writer.records()] == [record.id]
        assert writer.revoke(record.id).revoked_at is not None
        _until(lambda: a.authenticate(key) is None and b.authenticate(key) is None)
        with pytest.raises(InvalidInput, match="no active key"):
            writer.revoke(record.id)
        assert writer.records()[0].revoked_at is not None   # kept, as revoked
    finally:
        a.close()
        b.close()
        for store in (writer, a_store, b_store):
            store.close()


def test_the_cli_manages_the_clusters_keys(pg_server: PostgresServer, capsys: pytest.CaptureFixture[str]) -> None:
    url = pg_server.create_database("keys_cli")
    assert main(["keys", "--jobs-url", url, "create", "--tenant", "acme", "--role", "admin"]) == 0
    out = capsys.readouterr().out
    key_id = out.splitlines()[1].split()[1]
    assert "in postgresql://" in out and key_id in out
    assert main(["keys", "--jobs-url", url, "revoke", key_id]) == 0
    assert main(["keys", "--jobs-url", url, "list"]) == 0
    assert key_id in capsys.readouterr().out


def test_a_database_that_cannot_be_reached_is_a_key_store_error_without_the_password(tmp_path: Path) -> None:
    store = PgKeys("postgresql://ember:s3cret@127.0.0.1:1/nowhere", connect_timeout_s=1)
    with pytest.raises(KeyFileError, match="cannot reach the database server") as caught:
        store.records()
    assert "s3cret" not in caught.value.message
