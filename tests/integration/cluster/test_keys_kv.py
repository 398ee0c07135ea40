"""A cluster's API keys in Ray's KV (ember/cluster/keys_kv.py), against a real Ray (one local node): one entry per
key, a revoked key kept as revoked, and a node's ring (`SharedKeyRing`) following both."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import ray

from ember.core.access import Principal
from ember.errors import InvalidInput
from ember.keys.store import SharedKeyRing

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_keys_in_rays_kv_are_created_listed_revoked_and_followed_by_a_ring(local_ray: None) -> None:
    from ember.cluster.keys_kv import RayKeys

    store = RayKeys()
    ring = SharedKeyRing(store, "Ray's KV", refresh_s=0.1)
    try:
        made = [store.create("acme", "user") for _ in range(3)]
        assert sorted(r.id for r in store.records()) == sorted(r.id for r, _ in made)
        record, key = made[0]
        deadline = time.monotonic() + 5
        while ring.authenticate(key) is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert ring.authenticate(key) == Principal("acme", "user", record.id)
        store.revoke(record.id)
        while ring.authenticate(key) is not None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(InvalidInput, match="no active key"):
            store.revoke(record.id)
        assert {r.id: r.revoked_at is not None for r in store.records()}[record.id]
    finally:
        ring.close()
