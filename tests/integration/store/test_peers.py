"""Peer tier over real HTTP: stores behind real ember gateways on loopback, a real nginx origin.

A node with no weights fetches a model's chunks from the node that holds it (digests checked, the origin's
access log shows no chunk request); two nodes pulling the same model at once through a shared fetch gate pull
each chunk from the origin exactly once between them.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ember.keys.store import KeyRing
from ember.ports import free_port
from ember.store import WeightStore
from ember.store.hashing import digest_file
from ember.store.meters import TransferMeters
from ember.testing.nginx import NginxOrigin
from ember.testing.peers import ChunkServer, FakeCluster

TOKEN = "peer-test-token-0123456789"


def _chunk_requests(nginx: NginxOrigin) -> Counter[str]:
    return Counter(p.rsplit("/", 1)[-1] for p in nginx.requests() if "/chunks/" in p)


def _all_intact(store: WeightStore, key: str) -> bool:
    chunks = store.manifest(key).unique_chunks().values()
    return all(digest_file(store.disk.path(c.digest)) == c.digest for c in chunks)


def test_a_node_with_no_weights_fetches_them_from_the_peer_that_holds_them(
        make_store: Callable[..., WeightStore], checkpoint_dir: Path, nginx: NginxOrigin) -> None:
    make_store("pub", root=nginx.root, memory_dir=None).push(checkpoint_dir, "m:1")   # the origin has it too
    holder = make_store("a")
    holder.push(checkpoint_dir, "m:1")
    with ChunkServer(holder.config, cluster_token=TOKEN) as server:
        node = make_store("b", origin=nginx.url, peers=(server.url,), peer_token=TOKEN)
        manifest = node.pull("m:1")
    total = sum(c.size for c in manifest.unique_chunks().values())
    assert _all_intact(node, "m:1")
    assert _chunk_requests(nginx) == Counter()   # only the manifest came from the origin
    assert node.fetched_bytes() == {"peer": total, "origin": 0}


def test_a_node_measures_its_fetches_from_peers_from_the_origin_and_its_disk_reads(
        make_store: Callable[..., WeightStore], checkpoint_dir: Path, nginx: NginxOrigin) -> None:
    """Each figure is bytes over the time some transfer was in flight: never below bytes over the whole pull."""
    make_store("pub", root=nginx.root, memory_dir=None).push(checkpoint_dir, "m:1")
    holder = make_store("a")
    holder.push(checkpoint_dir, "m:1")
    with ChunkServer(holder.config, cluster_token=TOKEN) as server:
        near = make_store("b", origin=nginx.url, peers=(server.url,), peer_token=TOKEN)
        near.meters = TransferMeters(min_bytes=0)   # a small model: report from the first byte
        t0 = time.perf_counter()
        manifest = near.pull("m:1")
        peer_s = time.perf_counter() - t0
    far = make_store("c", origin=nginx.url)
    far.meters = TransferMeters(min_bytes=0)
    t0 = time.perf_counter()
    far.pull("m:1")
    origin_s = time.perf_counter() - t0
    total = sum(c.size for c in manifest.unique_chunks().values())
    fetched_near, fetched_far = near.meters.bandwidths(), far.meters.bandwidths()
    assert fetched_near.origin_bps is None and fetched_far.peer_bps is None
    assert fetched_near.peer_bps is not None and fetched_near.peer_bps >= total / peer_s
    assert fetched_far.origin_bps is not None and fetched_far.origin_bps >= total / origin_s
    far.flush()   # the memory tier filled from the disk tier: those reads are measured too
    assert far.meters.bandwidths().disk_bps is not None


def test_a_peer_that_refuses_the_token_leaves_the_origin_to_serve(
        make_store: Callable[..., WeightStore], checkpoint_dir: Path, nginx: NginxOrigin, tmp_path: Path) -> None:
    make_store("pub", root=nginx.root, memory_dir=None).push(checkpoint_dir, "m:1")
    holder = make_store("a")
    holder.push(checkpoint_dir, "m:1")
    with ChunkServer(holder.config, cluster_token=TOKEN, keys=KeyRing(tmp_path / "keys.json")) as server:
        node = make_store("b", origin=nginx.url, peers=(server.url,), peer_token="wrong-token-0123456789")
        manifest = node.pull("m:1")
    assert _all_intact(node, "m:1")
    assert set(_chunk_requests(nginx)) == set(manifest.unique_chunks())
    assert node.peers is not None and node.peers.counts().failed == len(manifest.unique_chunks())


def test_two_nodes_pulling_at_once_hit_the_origin_once_per_chunk(
        make_store: Callable[..., WeightStore], checkpoint_dir: Path, nginx: NginxOrigin) -> None:
    make_store("pub", root=nginx.root, memory_dir=None).push(checkpoint_dir, "m:1")
    cluster = FakeCluster()
    nodes: list[WeightStore] = []
    servers: list[ChunkServer] = []
    try:
        for name in ("b", "c"):
            port = free_port()
            view = cluster.node(f"http://127.0.0.1:{port}/")
            store = make_store(name, origin=nginx.url, peer_token=TOKEN, threads=2, directory=view, gate=view)
            servers.append(ChunkServer(store.config, cluster_token=TOKEN, port=port).start())
            nodes.append(store)
        threads = [threading.Thread(target=n.pull, args=("m:1",)) for n in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for server in servers:
            server.stop()
    digests = set(nodes[0].manifest("m:1").unique_chunks())
    fetched = _chunk_requests(nginx)
    assert set(fetched) == digests and max(fetched.values()) == 1
    assert all(cluster.grants[d] == 1 for d in digests)
    assert all(_all_intact(n, "m:1") for n in nodes)
    assert sum(n.fetched_bytes()["peer"] for n in nodes) > 0   # some chunks went node to node
