"""The weight store's peer tier on a cluster, without Ray: the one token, the controller's leases and holders
(`ChunkBook`, `ClusterState.chunk_holders`), and a node's directory and gate over it (`ClusterChunks`),
falling back to static peers and local leases when the controller is away."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.cluster.chunks import ChunkBook
from ember.cluster.join import one_token
from ember.cluster.peers import LOCAL, ClusterChunks, ManifestIndex, spread
from ember.cluster.state import ClusterState
from ember.errors import InvalidInput
from ember.store.manifest import Chunk, FileEntry, Manifest
from ember.testing.clock import FakeClock
from ember.testing.peers import StateChunks
from ember.wire.cluster import Held, NodeInventory
from ember.wire.contract import ModelContract

D = "a" * 64
STORE_MODEL = ModelContract.model_validate({
    "name": "m", "version": "1", "runtime": "python", "entrypoint": "x:Y", "weights": "store:w:1",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    "resources": {"slice": "cpu", "memory_mb": 100}})


def inv(node: str, local_bytes: int = 0) -> NodeInventory:
    return NodeInventory(node=node, url=f"http://{node}:8000", memory_mb=1000, free_memory_mb=1000,
                         slices={"cpu": 1}, free_slices={"cpu": 1}, disk_bps=1e9, net_bps=1e9,
                         held=(Held(model="m:1", bytes=100, local_bytes=local_bytes),), contracts=(STORE_MODEL,))


def test_a_node_takes_the_clusters_token_and_refuses_another() -> None:
    assert one_token(None, "cluster-token-0123456789") == "cluster-token-0123456789"
    assert one_token("cluster-token-0123456789", "cluster-token-0123456789") == "cluster-token-0123456789"
    with pytest.raises(InvalidInput, match="cluster_token: not the cluster's token"):
        one_token("my-own-token-0123456789", "cluster-token-0123456789")


def test_one_lease_per_chunk_until_released_or_expired_or_its_node_gone() -> None:
    book = ChunkBook(lease_ttl_s=60)
    lease = book.acquire(D, "a", now=0)
    assert lease is not None and book.acquire(D, "b", now=1) is None and book.acquire(D, "a", now=1) == lease
    book.release(D, lease, "a", landed=True)
    assert not book.leased(D, now=2) and book.landed(D) == {"a"}
    assert book.acquire(D, "b", now=3) is not None
    assert book.acquire(D, "c", now=62) is None and book.acquire(D, "c", now=64) is not None   # b's expired
    book.forget("c")
    assert not book.leased(D, now=65)
    book.forget("a")
    assert book.landed(D) == set() and book.granted == 3


def test_holders_are_nodes_that_landed_the_chunk_then_nodes_holding_the_whole_model() -> None:
    state = ClusterState(FakeClock(), token="t")
    for node, local in (("a", 0), ("b", 100), ("c", 0), ("d", 100)):
        state.report(inv(node, local))
    lease = state.chunks.acquire(D, "c", 0)
    assert lease is not None
    state.chunks.release(D, lease, "c", landed=True)
    assert state.chunk_holders(D, ("w:1",), "a") == ["http://c:8000", "http://b:8000", "http://d:8000"]
    assert state.chunk_holders(D, ("w:1",), "b") == ["http://c:8000", "http://d:8000"]   # never the asker
    assert state.chunk_holders(D, ("other:1",), "a") == ["http://c:8000"]   # the chunk of no model b, d hold
    state.remove("c")
    assert state.chunk_holders(D, (), "a") == []


@pytest.fixture
def root(tmp_path: Path) -> Path:
    entry = FileEntry(path="w.bin", size=100, chunks=(Chunk(digest=D, size=100),))
    manifest = Manifest(name="w", version="1", files=(entry,))
    path = tmp_path / manifest.ref.manifest_path
    path.parent.mkdir(parents=True)
    path.write_bytes(manifest.to_json())
    return tmp_path


def test_a_nodes_directory_and_gate_go_through_the_controller(root: Path) -> None:
    clock = FakeClock()
    state = ClusterState(clock, token="t")
    state.report(inv("a"))
    state.report(inv("b"))
    calls = StateChunks(state, clock)
    a = ClusterChunks("a", calls, ManifestIndex(root), ["http://static:8000"], clock=clock, sleep=clock.advance)
    c = ClusterChunks("c", calls, ManifestIndex(root), clock=clock, sleep=clock.advance, cache_s=1.0)
    assert ManifestIndex(root).models_of(D) == ("w:1",)
    assert a.holders(D) == ["http://static:8000/"]                     # nobody holds it: the static peer only
    lease = a.acquire(D)
    assert lease is not None and lease.token != LOCAL and c.acquire(D) is None
    before = clock.now()
    c.wait(D, timeout_s=1.0)                                           # a holds it: c waits the whole time
    assert clock.now() - before == pytest.approx(1.0)
    a.release(lease, landed=True)
    c.wait(D, timeout_s=1.0)
    assert clock.now() - before == pytest.approx(1.0)                  # released: back at once
    assert c.holders(D) == ["http://a:8000/"]                          # a landed it
    # b comes to hold all of w:1: asked once per cache_s for every chunk of the model, not per chunk.
    state.report(inv("b", 100))
    clock.advance(1.5)
    asked = calls.calls
    assert c.holders(D) == ["http://b:8000/"] and c.holders(D) == ["http://b:8000/"] and calls.calls == asked + 1


def test_a_models_chunks_spread_over_every_node_holding_it() -> None:
    holders = ["http://a:8000/", "http://b:8000/", "http://c:8000/"]
    digests = [f"{i:08x}" + "0" * 56 for i in range(30)]
    orders = [spread(d, holders) for d in digests]
    assert all(sorted(o) == holders for o in orders)                   # every holder, each once
    firsts = [o[0] for o in orders]
    assert {h: firsts.count(h) for h in holders} == dict.fromkeys(holders, 10)
    assert spread(digests[1], holders) == spread(digests[1], holders)   # the same chunk, the same order
    assert spread(D, ["http://a:8000/"]) == ["http://a:8000/"] and spread(D, []) == []


def test_the_controller_away_leaves_static_peers_and_local_leases_and_is_not_asked_for_a_while(root: Path) -> None:
    clock = FakeClock()
    calls = StateChunks(ClusterState(clock, token="t"), clock)
    calls.down = True
    a = ClusterChunks("a", calls, ManifestIndex(root), ["http://static:8000"], clock=clock, sleep=clock.advance,
                      retry_s=5.0)
    assert a.holders(D) == ["http://static:8000/"]
    lease = a.acquire(D)
    assert lease is not None and lease.token == LOCAL
    a.wait(D, 60)
    a.release(lease, landed=True)
    assert calls.calls == 1                     # one failure, then not asked again for retry_s
    calls.down = False
    clock.advance(5.0)
    assert a.holders(D) == ["http://static:8000/"] and calls.calls == 3   # the model's holders, then the chunk's


def test_a_local_cluster_creates_its_controller_with_the_token_its_nodes_are_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = pytest.importorskip("ember.cluster.one_host")
    monkeypatch.delenv("EMBER_CLUSTER_TOKEN", raising=False)
    given = [["--models", "m"], ["--cluster-token", "given-token-0123456789"]]
    assert local.LocalCluster(tmp_path, given).given_token() == "given-token-0123456789"
    assert local.LocalCluster(tmp_path, [[]], env={"EMBER_CLUSTER_TOKEN": "env-token-0123456789"}).given_token() \
        == "env-token-0123456789"
    assert local.LocalCluster(tmp_path, [["--models", "m"]]).given_token() is None
