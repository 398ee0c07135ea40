"""`GET /v2/store/chunks/{digest}`: a node's chunks for its peers; admin key or cluster token; 400 / 404."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from ember.gateway.app import create_app
from ember.gateway.auth import Auth
from ember.gateway.store_api import byte_range
from ember.keys.store import KeyFile, KeyRing
from ember.metrics import Metrics
from ember.store import StoreConfig, WeightStore
from ember.store.shared import SharedChunks
from ember.testing.service import FakeService

TOKEN = "cluster-token-0123456789"


@pytest.fixture
def held(tmp_path: Path) -> Iterator[tuple[StoreConfig, dict[str, bytes]]]:
    """A store root with one pushed file of two chunks (disk tier), and the chunks' bytes by digest."""
    config = StoreConfig(root=tmp_path / "store", memory_dir=None, fsync=False, file_chunk_size=4096)
    data = bytes(range(256)) * 24   # 6144 bytes: two chunks
    (tmp_path / "f.bin").write_bytes(data)
    with WeightStore(config) as store:
        manifest = store.push(tmp_path / "f.bin", "m:1")
    chunks = manifest.files[0].chunks
    yield config, {c.digest: data[i * 4096:i * 4096 + c.size] for i, c in enumerate(chunks)}


@pytest.fixture
def keyfile(tmp_path: Path) -> KeyFile:
    return KeyFile(tmp_path / "keys.json")


@pytest.fixture
def client(held: tuple[StoreConfig, dict[str, bytes]], keyfile: KeyFile) -> Iterator[TestClient]:
    auth = Auth(KeyRing(keyfile.path), cluster_token=TOKEN)
    with TestClient(create_app(FakeService(), Metrics(), auth=auth, chunks=SharedChunks(held[0]))) as c:
        yield c


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_peer_with_the_cluster_token_gets_the_chunk_and_ranges_of_it(
        client: TestClient, held: tuple[StoreConfig, dict[str, bytes]]) -> None:
    for digest, data in held[1].items():
        r = client.get(f"/v2/store/chunks/{digest}", headers=_bearer(TOKEN))
        assert r.status_code == 200 and r.content == data
        assert r.headers["content-type"] == "application/octet-stream"
        part = client.get(f"/v2/store/chunks/{digest}", headers={**_bearer(TOKEN), "Range": "bytes=10-99"})
        assert part.status_code == 206 and part.content == data[10:100]
        assert part.headers["content-range"] == f"bytes 10-99/{len(data)}"
        tail = client.get(f"/v2/store/chunks/{digest}", headers={**_bearer(TOKEN), "Range": "bytes=-5"})
        assert tail.status_code == 206 and tail.content == data[-5:]
        past = client.get(f"/v2/store/chunks/{digest}", headers={**_bearer(TOKEN), "Range": f"bytes={len(data)}-"})
        assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{len(data)}"


@pytest.mark.parametrize(("header", "span"), [
    (None, None), ("bytes=0-9", (0, 10)), ("bytes=5-", (5, 100)), ("bytes=-10", (90, 100)),
    ("bytes=90-1000", (90, 100)), ("bytes=100-", (100, 100)), ("bytes=0-1,5-9", None), ("items=0-1", None)])
def test_byte_ranges(header: str | None, span: tuple[int, int] | None) -> None:
    assert byte_range(header, 100) == span


def test_a_chunk_evicted_since_the_lookup_is_404_not_500(
        client: TestClient, held: tuple[StoreConfig, dict[str, bytes]]) -> None:
    digest = next(iter(held[1]))
    for path in (held[0].root / "chunks").rglob(digest + "*"):
        path.unlink()
    r = client.get(f"/v2/store/chunks/{digest}", headers=_bearer(TOKEN))
    assert r.status_code == 404, r.text


def test_an_admin_key_may_fetch_a_user_key_may_not_and_no_key_is_401(
        client: TestClient, held: tuple[StoreConfig, dict[str, bytes]], keyfile: KeyFile) -> None:
    digest = next(iter(held[1]))
    _, admin = keyfile.create("ops", "admin")
    _, user = keyfile.create("acme", "user")
    assert client.get(f"/v2/store/chunks/{digest}", headers=_bearer(admin)).status_code == 200
    assert client.get(f"/v2/store/chunks/{digest}", headers=_bearer(user)).status_code == 403
    assert client.get(f"/v2/store/chunks/{digest}").status_code == 401
    assert client.get(f"/v2/store/chunks/{digest}", headers=_bearer(TOKEN + "x")).status_code == 401
    # The cluster token opens the peer route only.
    assert client.get("/ember/status", headers=_bearer(TOKEN)).status_code == 401


@pytest.mark.parametrize("digest", ["abc", "Z" * 64, "0" * 63 + "G", "0" * 65, "ab" * 31 + "%00x"])
def test_a_malformed_digest_is_400_naming_the_field(client: TestClient, digest: str) -> None:
    r = client.get(f"/v2/store/chunks/{digest}", headers=_bearer(TOKEN))
    assert r.status_code == 400 and r.json()["error"].startswith("digest:")


def test_a_chunk_this_node_does_not_hold_is_404(client: TestClient) -> None:
    r = client.get(f"/v2/store/chunks/{'ab' * 32}", headers=_bearer(TOKEN))
    assert r.status_code == 404 and "not held" in r.json()["error"]


def test_a_gateway_without_a_store_answers_404() -> None:
    with TestClient(create_app(FakeService(), Metrics())) as c:
        assert c.get(f"/v2/store/chunks/{'ab' * 32}").status_code == 404


def test_a_peer_gets_a_manifest_the_store_holds_and_a_clear_error_otherwise(
        client: TestClient, held: tuple[StoreConfig, dict[str, bytes]]) -> None:
    r = client.get("/v2/store/manifests/m/1.json", headers=_bearer(TOKEN))
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert {c["digest"] for c in r.json()["files"][0]["chunks"]} == set(held[1])
    missing = client.get("/v2/store/manifests/other/1.json", headers=_bearer(TOKEN))
    assert missing.status_code == 404 and "other:1" in missing.json()["error"]
    bad = client.get("/v2/store/manifests/-x/1.json", headers=_bearer(TOKEN))
    assert bad.status_code == 400 and "name" in bad.json()["error"]
    assert client.get("/v2/store/manifests/m/1.json").status_code == 401
