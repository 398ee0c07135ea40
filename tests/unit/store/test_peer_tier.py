"""The peer tier: memory -> disk -> peers -> origin, a corrupt peer answer rejected and the next source tried,
and the fetch gate's single flight across nodes (fake sources and a fake cluster, real tier files in tmp)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ember.errors import ChunkCorrupt, StoreError
from ember.store import ModelRef, StoreConfig, WeightStore
from ember.store.hashing import digest_bytes
from ember.store.manifest import Chunk, FileEntry, Manifest
from ember.store.tiers import Source
from ember.store.tiers.peer import LocalGate, PeerDirectory, PeerTier, StaticPeers
from ember.testing.peers import FakeCluster, FakeClusterNode, MemorySource

DATA = [bytes([i]) * (4096 + i) for i in range(3)]
CHUNKS = [Chunk(digest=digest_bytes(d), size=len(d)) for d in DATA]
BY_DIGEST = {c.digest: d for c, d in zip(CHUNKS, DATA, strict=True)}
A, B, C = "http://a:8000/", "http://b:8000/", "http://c:8000/"


class Peers:
    """Fake peer sources by URL, connected through PeerTier's `connect`."""

    def __init__(self, **sources: MemorySource) -> None:
        self.sources = {f"http://{k}:8000/": s for k, s in sources.items()}

    def connect(self, url: str) -> Source:
        return self.sources[url]


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[list[WeightStore]]:
    made: list[WeightStore] = []
    yield made
    for s in made:
        s.close()


def _store(tmp_path: Path, made: list[WeightStore], name: str, origin: MemorySource | None, peers: Peers | None,
           urls: list[str], gate: FakeClusterNode | None = None) -> WeightStore:
    directory: PeerDirectory = gate if gate is not None else StaticPeers(urls)
    tier = PeerTier(directory, connect=peers.connect) if peers is not None else None
    store = WeightStore(StoreConfig(root=tmp_path / name, memory_dir=None, fsync=False, peer_wait_s=5),
                        origin=origin, peers=tier, gate=gate)
    made.append(store)
    return store


def _read(store: WeightStore, chunk: Chunk) -> bytes:
    tier = store.ensure(chunk, "m:1")
    return Path(tier.path(chunk.digest)).read_bytes()


def test_a_chunk_missing_locally_comes_from_a_peer_and_never_the_origin(tmp_path: Path,
                                                                         stores: list[WeightStore]) -> None:
    origin = MemorySource(BY_DIGEST, name="origin")
    peers = Peers(a=MemorySource(BY_DIGEST))
    store = _store(tmp_path, stores, "n", origin, peers, [A])
    assert [_read(store, c) for c in CHUNKS] == DATA
    assert sum(origin.reads.values()) == 0
    assert store.fetched_bytes() == {"peer": sum(map(len, DATA)), "origin": 0}
    # Now local: a second read asks no one.
    assert _read(store, CHUNKS[0]) == DATA[0]
    assert peers.sources[A].reads[CHUNKS[0].digest] == 1


def test_a_corrupt_peer_answer_is_rejected_and_the_next_peer_serves(tmp_path: Path,
                                                                     stores: list[WeightStore]) -> None:
    origin = MemorySource(BY_DIGEST, name="origin")
    peers = Peers(a=MemorySource(BY_DIGEST, corrupt=True), b=MemorySource(BY_DIGEST))
    store = _store(tmp_path, stores, "n", origin, peers, [A, B])
    assert _read(store, CHUNKS[1]) == DATA[1]
    assert store.peers is not None and store.peers.counts().rejected == 1
    assert peers.sources[B].reads[CHUNKS[1].digest] == 1 and sum(origin.reads.values()) == 0
    assert store.disk.present([CHUNKS[1]]) == {CHUNKS[1].digest}   # the good copy, verified


def test_peers_without_the_chunk_fall_back_to_the_origin(tmp_path: Path, stores: list[WeightStore]) -> None:
    origin = MemorySource(BY_DIGEST, name="origin")
    peers = Peers(a=MemorySource({}), b=MemorySource(BY_DIGEST, corrupt=True))
    store = _store(tmp_path, stores, "n", origin, peers, [A, B])
    assert _read(store, CHUNKS[2]) == DATA[2]
    assert store.peers is not None and store.peers.counts().failed == 1 and store.peers.counts().rejected == 1
    assert origin.reads[CHUNKS[2].digest] == 1
    assert store.fetched_bytes() == {"peer": 0, "origin": len(DATA[2])}


def test_a_corrupt_origin_is_still_an_error_naming_the_chunk(tmp_path: Path, stores: list[WeightStore]) -> None:
    store = _store(tmp_path, stores, "n", MemorySource(BY_DIGEST, name="origin", corrupt=True), Peers(), [])
    with pytest.raises(ChunkCorrupt, match=CHUNKS[0].digest):
        store.ensure(CHUNKS[0], "m:1")
    assert not store.disk.present([CHUNKS[0]])


def test_no_peer_no_origin_is_a_store_error(tmp_path: Path, stores: list[WeightStore]) -> None:
    store = _store(tmp_path, stores, "n", None, Peers(a=MemorySource({})), [A])
    with pytest.raises(StoreError, match="no origin"):
        store.ensure(CHUNKS[0], "m:1")


def test_while_another_node_pulls_from_the_origin_this_one_waits_and_fetches_from_it(
        tmp_path: Path, stores: list[WeightStore]) -> None:
    cluster = FakeCluster()
    origin = MemorySource(BY_DIGEST, name="origin")
    holder = MemorySource({})
    lease = cluster.node(A).acquire(CHUNKS[0].digest)   # node A is pulling chunk 0 from the origin
    assert lease is not None
    store = _store(tmp_path, stores, "b", origin, Peers(a=holder), [], gate=cluster.node(B))
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(_read(store, CHUNKS[0])))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()   # B waits for A's lease rather than going to the origin
    holder.chunks[CHUNKS[0].digest] = DATA[0]   # A landed it ...
    cluster.node(A).release(lease, landed=True)  # ... and says so
    waiter.join(5)
    assert got == [DATA[0]]
    assert sum(origin.reads.values()) == 0 and cluster.grants[CHUNKS[0].digest] == 1
    assert store.fetched_bytes()["peer"] == len(DATA[0])


def test_a_holder_that_fails_hands_the_lease_on(tmp_path: Path, stores: list[WeightStore]) -> None:
    cluster = FakeCluster()
    origin = MemorySource(BY_DIGEST, name="origin")
    lease = cluster.node(A).acquire(CHUNKS[1].digest)
    assert lease is not None
    store = _store(tmp_path, stores, "b", origin, Peers(a=MemorySource({})), [], gate=cluster.node(B))
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(_read(store, CHUNKS[1])))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()
    cluster.node(A).release(lease, landed=False)   # A's origin fetch failed
    waiter.join(5)
    assert got == [DATA[1]]
    assert origin.reads[CHUNKS[1].digest] == 1 and cluster.grants[CHUNKS[1].digest] == 2
    assert cluster.node(A).holders(CHUNKS[1].digest) == [B]   # B landed it: A would now fetch it from B


def test_the_gate_grants_one_lease_per_chunk_and_wakes_waiters_on_release() -> None:
    cluster = FakeCluster()
    a, b = cluster.node(A), cluster.node(B)
    lease = a.acquire("d1")
    assert lease is not None and b.acquire("d1") is None and b.acquire("d2") is not None
    released = threading.Event()

    def wait() -> None:
        b.wait("d1", 5)
        released.set()

    t = threading.Thread(target=wait)
    t.start()
    assert not released.wait(0.1)
    a.release(lease, landed=True)
    assert released.wait(5)
    t.join()
    assert b.holders("d1") == [A] and a.holders("d1") == []   # never a node's own URL
    assert b.acquire("d1") is not None   # free again


def test_the_local_gate_always_grants_and_static_peers_list_every_url() -> None:
    gate = LocalGate()
    assert gate.acquire("d") is not None and gate.acquire("d") is not None
    gate.wait("d", 10)   # returns at once
    assert StaticPeers(["http://a:8000", C]).holders("d") == [A, C]


class ManifestSource(MemorySource):
    """A peer that also serves manifests (`GET /v2/store/manifests/...`), by path."""

    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__()
        self.files = files

    def fetch(self, path: str) -> bytes | None:
        return self.files.get(path)


def test_a_peer_answering_a_bad_manifest_is_skipped_and_the_next_one_serves(tmp_path: Path,
                                                                           stores: list[WeightStore]) -> None:
    ref = ModelRef.parse("image-k:1")
    path = f"v2/store/{ref.manifest_path}"
    good = Manifest(name="image-k", version="1", files=(FileEntry(path="pages-1.img", size=CHUNKS[0].size,
                                                                  chunks=(CHUNKS[0],)),))
    other = good.model_copy(update={"name": "image-x"})
    peers = Peers(a=ManifestSource({path: b"not json"}), b=ManifestSource({path: other.to_json()}),
                  c=ManifestSource({path: good.to_json()}))
    store = WeightStore(StoreConfig(root=tmp_path / "n", memory_dir=None, fsync=False),
                        peers=PeerTier(StaticPeers([A, B, C]), connect=peers.connect))
    stores.append(store)
    assert store.peer_manifest(ref) == good
    assert store.manifest(ref) == good
