"""API keys: one small JSON file under the server's state dir, written by `ember keys`, read by the server.

A key is `ember_<id>_<secret>`: a public 12-hex-digit id (what `ember keys list` and `revoke` name) and
32 random bytes (`secrets.token_urlsafe`). Only the SHA-256 of the whole key is stored; the key itself is
printed once, when it is created. A high-entropy key needs no slow hash: nobody can guess a preimage.
Authentication finds the record by id and compares hashes with `hmac.compare_digest`, so the time it takes
does not depend on how much of a guess was right.

The file (`keys.json`, mode 0600) is replaced atomically (a temporary file, fsync, rename) under an
exclusive `flock`, so two `ember keys` commands never lose each other's writes and the server never reads
half a file. The server's `KeyRing` re-reads it whenever its stamp (inode, size, mtime) changes: a key
created or revoked takes effect on the next request, without a restart. A file the server cannot parse
fails closed (no key is valid) and is logged.

A cluster's keys are the cluster's (`SharedKeyRing`): kept in a store every node reads (`KeyStore`: the shared
job database, ember/keys/postgres.py, or Ray's KV, ember/cluster/keys_kv.py), read again every `refresh_s` on a
thread of their own, so a key created on one node is accepted on every node, and a revoked one refused
everywhere, within `refresh_s` (a second) of the change. A node that cannot read the store keeps the keys it
read last (logged) until it can. A server has both: its state dir's file and, in a cluster, the shared store
(`KeyRings`: a key valid in either is valid).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ember.core.access import Principal, Role
from ember.errors import InvalidInput, StoreError
from ember.wire.refs import NAME_PATTERN

log = logging.getLogger("ember.keys")

KEYS_FILE = "keys.json"
_KEY = re.compile(r"^ember_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")


class KeyFileError(StoreError):
    """The key file cannot be read or written (permissions, disk full, not ember's JSON)."""


class KeyRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[0-9a-f]{12}$")
    tenant: str = Field(pattern=NAME_PATTERN)
    role: Role
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    created_at: float
    revoked_at: float | None = None


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal[1] = 1
    keys: list[KeyRecord] = []


def keys_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / KEYS_FILE


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check_tenant(tenant: str) -> str:
    if not re.fullmatch(NAME_PATTERN, tenant):
        raise InvalidInput(f"--tenant: {tenant!r} is not a valid tenant name (letters, digits, '_', '.', '-'; "
                           "starting with a letter or digit; at most 128 characters)")
    return tenant


def _parse(raw: bytes, path: Path) -> _File:
    if not raw.strip():
        return _File()
    try:
        return _File.model_validate_json(raw)
    except ValidationError as err:
        raise KeyFileError(f"key file {path}: not an ember key file: {err.errors()[0]['msg']}") from None


class KeyFile:
    """Create, list and revoke keys (what the `ember keys` commands do)."""

    def __init__(self, path: str | Path, wall: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self._wall = wall

    def records(self) -> list[KeyRecord]:
        try:
            return _parse(self.path.read_bytes(), self.path).keys
        except FileNotFoundError:
            return []
        except OSError as err:
            raise KeyFileError(f"key file {self.path}: cannot read: {err}") from None

    def create(self, tenant: str, role: Role) -> tuple[KeyRecord, str]:
        """A new key for `tenant`: its record and the key itself (shown once; only its hash is kept)."""
        check_tenant(tenant)
        with self._locked() as data:
            record, key = new_key(tenant, role, {k.id for k in data.keys}, self._wall())
            data.keys.append(record)
        return record, key

    def revoke(self, key_id: str) -> KeyRecord:
        with self._locked() as data:
            for i, record in enumerate(data.keys):
                if record.id == key_id and record.revoked_at is None:
                    data.keys[i] = record.model_copy(update={"revoked_at": self._wall()})
                    return data.keys[i]
        raise InvalidInput(f"ID: no active key with id {key_id!r} in {self.path} (see `ember keys list`)")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[_File]:
        """The file's contents to change; written back (atomically, 0600) when the block ends without error."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock_fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:
            raise KeyFileError(f"key file {self.path}: cannot lock: {err}") from None
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            data = _File(keys=self.records())
            yield data
            self._write(data)
        finally:
            os.close(lock_fd)

    def _write(self, data: _File) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.fchmod(fd, 0o600)  # whatever the umask, and if a stale temp file had other bits
                os.write(fd, data.model_dump_json(indent=2).encode() + b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as err:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise KeyFileError(f"key file {self.path}: cannot write: {err}") from None


class KeyStore(Protocol):
    """Where keys are kept (`KeyFile`, the shared job database, Ray's KV): what `ember keys` does to them."""

    def records(self) -> list[KeyRecord]: ...

    def create(self, tenant: str, role: Role) -> tuple[KeyRecord, str]: ...

    def revoke(self, key_id: str) -> KeyRecord: ...


def new_key(tenant: str, role: Role, taken: set[str], now: float) -> tuple[KeyRecord, str]:
    """A fresh key (an id not in `taken`) and its record."""
    check_tenant(tenant)
    key_id = secrets.token_hex(6)
    while key_id in taken:
        key_id = secrets.token_hex(6)
    key = f"ember_{key_id}_{secrets.token_urlsafe(32)}"
    return KeyRecord(id=key_id, tenant=tenant, role=role, sha256=digest(key), created_at=now), key


def match(by_id: dict[str, KeyRecord], key: str) -> Principal | None:
    """The principal of `key` among active records by id; None for a malformed, unknown or revoked key."""
    found = _KEY.match(key)
    record = by_id.get(found.group(1)) if found else None
    # Hash even when there is no record, so an unknown id costs as long as a wrong secret.
    presented = digest(key)
    if record is None or not hmac.compare_digest(presented, record.sha256):
        return None
    return Principal(record.tenant, record.role, record.id)


class SharedKeyRing:
    """The server's side of a cluster's key store: its active keys in memory, read again every `refresh_s` on a
    thread of its own (`close` stops it). The first read happens before the constructor returns."""

    def __init__(self, store: KeyStore, where: str, refresh_s: float = 1.0) -> None:
        self._store, self.where, self.refresh_s = store, where, refresh_s
        self._by_id: dict[str, KeyRecord] = {}
        self._failing = False
        self.reads = 0
        self._stop = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="ember-keys", daemon=True)
        self._thread.start()

    def refresh(self) -> None:
        try:
            records = self._store.records()
        except StoreError as err:
            if not self._failing:
                log.error("API keys: cannot read %s (%s); keeping the %d keys read last until it can",
                          self.where, err.message, len(self._by_id))
            self._failing = True
            return
        by_id = {r.id: r for r in records if r.revoked_at is None}
        if self._failing or by_id.keys() != self._by_id.keys():
            log.info("API keys: %d active in %s", len(by_id), self.where)
        self._by_id, self._failing = by_id, False   # one assignment: a request sees the old or the new set
        self.reads += 1

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh()

    def authenticate(self, key: str) -> Principal | None:
        return match(self._by_id, key)

    def active(self) -> int:
        return len(self._by_id)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class KeyRings:
    """Several key sources at once (a node's file and the cluster's store): a key valid in one is valid."""

    def __init__(self, rings: Sequence[KeyRing | SharedKeyRing]) -> None:
        self.rings = list(rings)

    def authenticate(self, key: str) -> Principal | None:
        for ring in self.rings:
            principal = ring.authenticate(key)
            if principal is not None:
                return principal
        return None

    def active(self) -> int:
        return sum(r.active() for r in self.rings)

    def close(self) -> None:
        for ring in self.rings:
            if isinstance(ring, SharedKeyRing):
                ring.close()


class KeyRing:
    """The server's side: which principal a presented key is, re-reading the file when it changes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None
        self._by_id: dict[str, KeyRecord] = {}

    def authenticate(self, key: str) -> Principal | None:
        """The key's principal; None for a malformed, unknown or revoked key."""
        self._refresh()
        return match(self._by_id, key)

    def active(self) -> int:
        self._refresh()
        return len(self._by_id)

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._stamp, self._by_id = None, {}
            return
        except OSError as err:
            self._fail(f"cannot stat: {err}", None)
            return
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._stamp:
            return
        try:
            data = _parse(self.path.read_bytes(), self.path)
        except (OSError, KeyFileError) as err:
            self._fail(str(err), stamp)
            return
        self._stamp = stamp
        self._by_id = {k.id: k for k in data.keys if k.revoked_at is None}
        if st.st_mode & 0o077:
            log.warning("key file %s is readable by others (mode %o); it should be 0600", self.path, st.st_mode & 0o777)
        log.info("API keys: %d active in %s", len(self._by_id), self.path)

    def _fail(self, why: str, stamp: tuple[int, int, int] | None) -> None:
        # Fail closed: a key file that cannot be read validates no key (logged once per change of the file).
        if stamp is None or stamp != self._stamp:
            log.error("API keys: %s; no key is valid until it is fixed", why)
        self._stamp, self._by_id = stamp, {}
