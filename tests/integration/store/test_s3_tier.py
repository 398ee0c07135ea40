"""The S3 origin against a real S3-compatible server (moto's, on loopback): a store root copied into a bucket."""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer
from safetensors.torch import load_file

from ember.cli import main as cli_main
from ember.errors import ChunkCorrupt, ModelNotFound, StoreError, TierUnavailable
from ember.store import WeightStore, open_tensors
from ember.testing.checkpoints import mismatches

PART = 64 * 1024  # the smallest part size StoreConfig allows: the checkpoint's larger tensors come in several parts


@dataclass
class Bucket:
    name: str
    endpoint: str

    def client(self) -> Any:
        return boto3.session.Session().client("s3", endpoint_url=self.endpoint)

    def upload(self, root: Path, prefix: str) -> None:
        """Copy a store root's chunks and manifests under `prefix`, as a publisher would (aws s3 sync)."""
        client = self.client()
        for path in sorted(root.glob("chunks/*/*")) + sorted(root.glob("manifests/**/*.json")):
            client.put_object(Bucket=self.name, Key=prefix + path.relative_to(root).as_posix(), Body=path.read_bytes())

    def flip(self, key: str, at: int = 100) -> None:
        client = self.client()
        data = bytearray(client.get_object(Bucket=self.name, Key=key)["Body"].read())
        data[at] ^= 0xFF
        client.put_object(Bucket=self.name, Key=key, Body=bytes(data))


def _isolate_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, endpoint: str) -> None:
    """boto3's standard configuration, from the environment only (never the user's ~/.aws)."""
    for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_RETRY_MODE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no credentials from an instance role either
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # a refused connection fails at once, not after backoffs


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    """One server for the module (stopping one takes half a second); each test has a bucket of its own."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, request: pytest.FixtureRequest) -> Bucket:
    _isolate_aws(monkeypatch, tmp_path, moto_endpoint)
    bucket = Bucket("ember-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16], moto_endpoint)
    bucket.client().create_bucket(Bucket=bucket.name)
    return bucket


@pytest.fixture
def published(s3: Bucket, make_store: Callable[..., WeightStore], checkpoint_dir: Path) -> str:
    """m:1 pushed into a local root, copied under a prefix of the bucket; returns the origin URL."""
    publisher = make_store("pub", memory_dir=None)
    publisher.push(checkpoint_dir, "m:1")
    s3.upload(publisher.root, "store/v1/")
    return f"s3://{s3.name}/store/v1"


def test_a_model_in_a_bucket_opens_bit_for_bit(
    make_store: Callable[..., WeightStore], checkpoint_dir: Path, published: str
) -> None:
    node = make_store("node", origin=published, part_size=PART)
    sizes = [c.size for c in node.manifest("m:1").unique_chunks().values()]
    # both paths: chunks in one GET (hashed as they arrive) and chunks in parallel parts, the last one short
    assert min(sizes) <= PART and any(s > PART and s % PART for s in sizes)
    tensors = open_tensors("m:1", store=node)
    assert mismatches(load_file(checkpoint_dir / "model.safetensors"), dict(tensors.items())) == []
    files = node.materialize("m:1")
    assert (files / "config.json").read_bytes() == (checkpoint_dir / "config.json").read_bytes()
    assert node.models(remote=True) == ["m:1"]


def test_the_cli_pulls_from_an_s3_origin(
    tmp_path: Path, checkpoint_dir: Path, published: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pulled"
    args = ["store", "--root", str(tmp_path / "cli"), "--origin", published, "--no-memory", "--quiet"]
    assert cli_main([*args, "pull", "m:1", "--to", str(out)]) == 0
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (checkpoint_dir / name).read_bytes()
    assert cli_main([*args, "ls"]) == 0
    assert "m:1" in capsys.readouterr().out.split()


def test_a_model_missing_from_the_bucket_is_model_not_found(
    make_store: Callable[..., WeightStore], published: str
) -> None:
    node = make_store("node", origin=published)
    with pytest.raises(ModelNotFound, match=f"origin {published}/ has no model other:1"):
        node.manifest("other:1")


@pytest.mark.parametrize("which", [min, max], ids=["one-get", "parallel-parts"])
def test_a_corrupt_chunk_in_the_bucket_names_model_and_chunk(
    make_store: Callable[..., WeightStore], s3: Bucket, published: str, which: Callable[..., Any]
) -> None:
    node = make_store("node", origin=published, part_size=PART)
    chunks = [c for c in node.manifest("m:1").unique_chunks().values() if c.size > 100]
    digest = which(chunks, key=lambda c: c.size).digest
    s3.flip(f"store/v1/chunks/{digest[:2]}/{digest}")
    with pytest.raises(ChunkCorrupt, match=f"model m:1: chunk {digest} is corrupt in the origin tier"):
        node.pull("m:1")
    assert digest not in node.disk.digests()


def test_a_chunk_missing_from_the_bucket_is_a_store_error_naming_it(
    make_store: Callable[..., WeightStore], s3: Bucket, published: str
) -> None:
    node = make_store("node", origin=published)
    digest = next(iter(node.manifest("m:1").unique_chunks()))
    s3.client().delete_object(Bucket=s3.name, Key=f"store/v1/chunks/{digest[:2]}/{digest}")
    with pytest.raises(StoreError, match=f"origin {published}/ has no chunk {digest}"):
        node.pull("m:1")


def test_an_unreachable_endpoint_is_tier_unavailable_naming_the_origin(
    make_store: Callable[..., WeightStore], monkeypatch: pytest.MonkeyPatch, published: str
) -> None:
    node = make_store("node", origin=published)
    node.manifest("m:1")  # the manifest is local now, its chunks are not
    with socket.socket() as sock:  # a port nothing listens on once the socket is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    down = make_store("down", origin=published, root=node.root)
    with pytest.raises(TierUnavailable, match=f"origin {published}/ is unreachable"):
        down.pull("m:1")
    with pytest.raises(TierUnavailable, match=f"origin {published}/ is unreachable"):
        down.manifest("never:1")


def test_a_missing_bucket_is_tier_unavailable_naming_it(make_store: Callable[..., WeightStore], s3: Bucket) -> None:
    node = make_store("node", origin="s3://no-such-bucket-here/store")
    with pytest.raises(TierUnavailable, match="origin s3://no-such-bucket-here/store/ answered NoSuchBucket"):
        node.manifest("m:1")


def test_missing_credentials_are_tier_unavailable_saying_so(
    make_store: Callable[..., WeightStore], monkeypatch: pytest.MonkeyPatch, published: str
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    node = make_store("node", origin=published)
    with pytest.raises(TierUnavailable, match=f"origin {published}/: no AWS credentials found"):
        node.manifest("m:1")
