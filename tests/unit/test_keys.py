"""The API key file: hashed keys, mode 0600, atomic updates, the server's ring re-reading it on change."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest

from ember.cli import main
from ember.core.access import Principal
from ember.errors import InvalidInput
from ember.keys.store import KeyFile, KeyRing, digest, keys_path


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return keys_path(tmp_path / "state")


def test_a_created_key_authenticates_as_its_tenant_and_role(path: Path) -> None:
    record, key = KeyFile(path).create("acme", "admin")
    assert key.startswith(f"ember_{record.id}_") and len(key) > 50
    assert KeyRing(path).authenticate(key) == Principal("acme", "admin", record.id)


def test_the_file_holds_only_a_hash_and_is_mode_0600(path: Path) -> None:
    old = os.umask(0o022)
    try:
        _, key = KeyFile(path).create("acme", "user")
    finally:
        os.umask(old)
    text = path.read_text()
    assert key not in text and key.split("_", 2)[2] not in text and digest(key) in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("wrong", ["", "Bearer", "ember_", "ember_000000000000_" + "A" * 43, "x" * 5000])
def test_unknown_and_malformed_keys_are_refused(path: Path, wrong: str) -> None:
    _, key = KeyFile(path).create("acme", "user")
    ring = KeyRing(path)
    assert ring.authenticate(wrong) is None
    assert ring.authenticate(key[:-1] + ("A" if key[-1] != "A" else "B")) is None  # right id, wrong secret


def test_the_ring_sees_keys_created_and_revoked_after_it_started(path: Path) -> None:
    keys, ring = KeyFile(path), KeyRing(path)
    first, key1 = keys.create("acme", "user")
    assert ring.authenticate(key1) is not None
    _, key2 = keys.create("other", "user")
    second = ring.authenticate(key2)
    assert second is not None and (second.tenant, second.role) == ("other", "user")
    keys.revoke(first.id)
    assert ring.authenticate(key1) is None and ring.authenticate(key2) is not None
    assert [r.revoked_at is not None for r in keys.records()] == [True, False]


def test_revoking_an_unknown_id_names_it(path: Path) -> None:
    with pytest.raises(InvalidInput, match="no active key with id 'nope'"):
        KeyFile(path).revoke("nope")


def test_bad_tenant_names_are_refused(path: Path) -> None:
    with pytest.raises(InvalidInput, match="--tenant"):
        KeyFile(path).create("../etc", "user")


def test_an_unreadable_file_fails_closed_and_says_so(path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, key = KeyFile(path).create("acme", "user")
    ring = KeyRing(path)
    assert ring.authenticate(key) is not None
    path.write_text("{not json")
    with caplog.at_level(logging.ERROR, "ember.keys"):
        assert ring.authenticate(key) is None
    assert "no key is valid" in caplog.text and key not in caplog.text


def test_the_cli_creates_lists_and_revokes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = str(tmp_path / "state")
    assert main(["keys", "--state-dir", state, "create", "--tenant", "acme", "--role", "admin", "--json"]) == 0
    created = json.loads(capsys.readouterr().out)
    assert KeyRing(keys_path(state)).authenticate(created["key"]) == Principal("acme", "admin", created["id"])
    assert main(["keys", "--state-dir", state, "list"]) == 0
    listing = capsys.readouterr().out
    assert created["id"] in listing and "acme" in listing and created["key"] not in listing
    assert main(["keys", "--state-dir", state, "revoke", created["id"]]) == 0
    assert KeyRing(keys_path(state)).authenticate(created["key"]) is None
    assert main(["keys", "--state-dir", state, "revoke", created["id"]]) == 2
    assert "no active key" in capsys.readouterr().err
