"""Weight chunks between nodes over mutual TLS: a node's store fetches from a peer's TLS gateway (keys on) with
its node certificate of the cluster CA, and no token; a store whose certificate is another CA's is refused at the
handshake and falls back to the origin."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ember.cluster.ca import init_ca, issue
from ember.gateway.app import create_app
from ember.gateway.auth import Auth
from ember.gateway.connections import guarded_protocol
from ember.keys.store import KeyRing
from ember.metrics import Metrics
from ember.store import WeightStore
from ember.store.shared import SharedChunks
from ember.testing.asgi import ThreadedServer
from ember.testing.nginx import NginxOrigin
from ember.testing.service import FakeService
from ember.tls import NodeTls


def test_a_store_fetches_a_peers_chunks_over_mutual_tls_and_another_cas_node_is_refused(
        make_store: Callable[..., WeightStore], checkpoint_dir: Path, nginx: NginxOrigin, tmp_path: Path) -> None:
    pki, rogue = tmp_path / "pki", tmp_path / "rogue"
    init_ca(pki)
    init_ca(rogue)
    a, b, c = issue(pki, "a", ["127.0.0.1"]), issue(pki, "b"), issue(rogue, "c")
    make_store("pub", root=nginx.root, memory_dir=None).push(checkpoint_dir, "m:1")
    holder = make_store("a")
    holder.push(checkpoint_dir, "m:1")
    app = create_app(FakeService(), Metrics(), auth=Auth(KeyRing(tmp_path / "no-keys.json")),
                     chunks=SharedChunks(holder.config))
    with ThreadedServer(app, log_level="critical", http=guarded_protocol(10, 100),
                        **NodeTls.of(a).server_kwargs()) as server:
        assert server.url.startswith("https://")
        node = make_store("b", origin=nginx.url, peers=(server.url + "/",), peer_tls_dir=b)
        manifest = node.pull("m:1")
        total = sum(ch.size for ch in manifest.unique_chunks().values())
        assert node.fetched_bytes() == {"peer": total, "origin": 0}
        stranger = make_store("c", origin=nginx.url, peers=(server.url + "/",), peer_tls_dir=c)
        stranger.pull("m:1")
        assert stranger.fetched_bytes() == {"peer": 0, "origin": total}
