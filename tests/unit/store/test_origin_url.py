"""Origin URLs: http(s) and s3 accepted at the edge, anything else an error naming the key; boto3 optional."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ember.config import load_serve_config
from ember.errors import InvalidInput, StoreError
from ember.store import StoreConfig, WeightStore
from ember.store.tiers.s3 import S3Tier, parse_s3_url


@pytest.mark.parametrize(("given", "kept"), [
    ("s3://weights", "s3://weights/"),
    ("s3://weights/store/v1", "s3://weights/store/v1/"),
    ("http://origin:8080/store", "http://origin:8080/store/"),
    ("https://cdn.example/", "https://cdn.example/"),
])
def test_http_and_s3_origins_are_kept_with_a_trailing_slash(given: str, kept: str, tmp_path: Path) -> None:
    assert StoreConfig.build(root=tmp_path, origin=given).origin == kept


@pytest.mark.parametrize(("given", "says"), [
    ("s3://", "needs a bucket name"),
    ("s3:///prefix", "needs a bucket name"),
    ("s3://Bad_Bucket/x", "needs a bucket name"),
    ("ftp://x", r"s3://, http:// or https://.*ftp://x"),
    ("http://", r"s3://, http:// or https://"),
    ("bucket/prefix", r"s3://, http:// or https://"),
])
def test_a_bad_origin_names_the_key(given: str, says: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match=f"store config: origin: .*{says}"):
        StoreConfig.build(root=tmp_path, origin=given)


def test_serve_takes_an_s3_store_origin_and_names_its_key_when_bad() -> None:
    assert load_serve_config(store_origin="s3://weights/store").store_config().origin == "s3://weights/store/"
    with pytest.raises(InvalidInput, match="store_origin: .*needs a bucket name"):
        load_serve_config(store_origin="s3://")


def test_s3_urls_split_into_bucket_and_key_prefix() -> None:
    assert parse_s3_url("s3://weights/") == ("weights", "")
    assert parse_s3_url("s3://weights/store/v1/") == ("weights", "store/v1/")
    with pytest.raises(StoreError, match="not an s3:// URL"):
        parse_s3_url("http://weights/")


def test_without_boto3_an_s3_origin_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # what `import boto3` meets where it is not installed
    with pytest.raises(StoreError, match=r"origin s3://weights/ needs boto3: pip install 'ember\[s3\]'"):
        S3Tier("s3://weights/")
    with pytest.raises(StoreError, match="needs boto3"):
        WeightStore(StoreConfig(root=tmp_path / "root", memory_dir=None, origin="s3://weights"))
    assert not (tmp_path / "root").exists()  # failed before any local tier was opened
