"""A cluster's API keys in Ray's KV (the GCS), for a cluster without a shared job database (`--allow-local-jobs`).

One KV entry per key (namespace `ember`, key `apikey:ID`, the record as JSON: the SHA-256 of the whole key, never
the key), so two nodes creating keys at once never overwrite each other; a revoked key keeps its entry with
`revoked_at` set. `ember keys --ray ADDRESS create|list|revoke` write them, and every node of the cluster reads
them (`ember.keys.store.SharedKeyRing`, every second). Needs a connected Ray driver (the serve process is one).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pydantic import ValidationError
from ray.experimental import internal_kv

from ember.core.access import Role
from ember.errors import InvalidInput
from ember.keys.store import KeyFileError, KeyRecord, new_key

NAMESPACE = "ember"
PREFIX = b"apikey:"


class RayKeys:
    """Implements `ember.keys.store.KeyStore` over Ray's internal KV."""

    where = "Ray's KV"

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self._wall = wall

    def _ids(self) -> list[bytes]:
        try:
            return sorted(internal_kv._internal_kv_list(PREFIX, namespace=NAMESPACE))
        except Exception as err:   # Ray's errors (the GCS away) and its client's
            raise KeyFileError(f"API keys in Ray's KV: cannot list: {type(err).__name__}: {err}") from None

    def _get(self, name: bytes) -> KeyRecord | None:
        try:
            raw = internal_kv._internal_kv_get(name, namespace=NAMESPACE)
        except Exception as err:
            raise KeyFileError(f"API keys in Ray's KV: cannot read: {type(err).__name__}: {err}") from None
        try:
            return None if raw is None else KeyRecord.model_validate_json(raw)
        except ValidationError:
            return None   # not ember's: skipped (`ember keys list` shows what is there)

    def _put(self, record: KeyRecord, overwrite: bool) -> bool:
        try:
            existed = internal_kv._internal_kv_put(PREFIX + record.id.encode(), record.model_dump_json().encode(),
                                                   overwrite=overwrite, namespace=NAMESPACE)
        except Exception as err:
            raise KeyFileError(f"API keys in Ray's KV: cannot write: {type(err).__name__}: {err}") from None
        return not existed   # whether this put made the entry

    def records(self) -> list[KeyRecord]:
        return [r for r in (self._get(name) for name in self._ids()) if r is not None]

    def create(self, tenant: str, role: Role) -> tuple[KeyRecord, str]:
        taken = {name.removeprefix(PREFIX).decode() for name in self._ids()}
        while True:
            record, key = new_key(tenant, role, taken, self._wall())
            if self._put(record, overwrite=False):   # not there before (another node's new key never lost)
                return record, key
            taken.add(record.id)

    def revoke(self, key_id: str) -> KeyRecord:
        record = self._get(PREFIX + key_id.encode())
        if record is None or record.revoked_at is not None:
            raise InvalidInput(f"ID: no active key with id {key_id!r} in Ray's KV (see `ember keys list`)")
        revoked = record.model_copy(update={"revoked_at": self._wall()})
        self._put(revoked, overwrite=True)
        return revoked
