"""Eviction at capacity, corruption detected and refetched, the origin going down."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ember.errors import ChunkCorrupt, TierUnavailable
from ember.store import WeightStore, open_tensors
from ember.store.tiers.files import BOOT_ID
from ember.testing.checkpoints import mismatches, small_specs, write_checkpoint
from ember.testing.clock import FakeClock
from ember.testing.nginx import NginxOrigin


def _flip(path: str, at: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def _biggest(store: WeightStore, key: str) -> str:
    return max(store.manifest(key).unique_chunks().values(), key=lambda c: c.size).digest


def test_memory_tier_evicts_least_recently_used(make_store: Callable[..., WeightStore], tmp_path: Path) -> None:
    clock = FakeClock()
    a = write_checkpoint(tmp_path / "a" / "model.safetensors", small_specs(seed=1))
    b = write_checkpoint(tmp_path / "b" / "model.safetensors", small_specs(seed=2))
    size = a.stat().st_size
    store = make_store(memory_capacity=int(size * 1.5))
    store.memory._clock = clock  # type: ignore[union-attr]
    store.push(a.parent, "a:1")
    store.push(b.parent, "b:1")
    assert store.memory is not None
    store.pull("a:1")
    store.flush()  # pull returns once the chunks are on disk; the memory tier fills behind it
    a_chunks = set(store.manifest("a:1").unique_chunks())
    assert a_chunks <= store.memory.digests()
    clock.advance(10)
    store.pull("b:1")  # b does not fit beside a: a's chunks, used longest ago, go first
    store.flush()
    usage = store.memory.usage()
    assert usage.used <= usage.capacity  # type: ignore[operator]
    assert set(store.manifest("b:1").unique_chunks()) <= store.memory.digests()
    assert len(a_chunks & store.memory.digests()) < len(a_chunks)
    # the disk tier still holds everything pushed (pinned), so both models still open bit for bit
    assert mismatches(load_file(a), dict(open_tensors("a:1", store=store).items())) == []


def test_memory_tier_fills_from_disk_once_the_load_is_done(
    make_store: Callable[..., WeightStore], checkpoint_dir: Path
) -> None:
    store = make_store()
    store.push(checkpoint_dir, "m:1")  # pushed chunks land on disk only
    assert store.memory is not None
    chunks = [c for c in store.manifest("m:1").tensor_chunks().values() if c is not None]
    expected = load_file(checkpoint_dir / "model.safetensors")
    store.pause_fills()  # as a load's prefetch does while it runs
    assert mismatches(expected, dict(open_tensors("m:1", store=store, prefetch=False).items())) == []
    time.sleep(0.2)
    assert not {c.digest for c in chunks} & store.memory.digests()  # the copies wait for the load
    store.resume_fills()
    store.flush()
    assert set(store.locate(chunks).values()) == {store.memory}
    assert mismatches(expected, dict(open_tensors("m:1", store=store).items())) == []


def test_disk_cache_evicts_fetched_chunks_but_never_pushed_ones(
    make_store: Callable[..., WeightStore], tmp_path: Path, nginx: NginxOrigin
) -> None:
    a = write_checkpoint(tmp_path / "a" / "model.safetensors", small_specs(seed=1))
    b = write_checkpoint(tmp_path / "b" / "model.safetensors", small_specs(seed=2))
    publisher = make_store("pub", root=nginx.root, memory_dir=None)
    publisher.push(a.parent, "a:1")
    publisher.push(b.parent, "b:1")
    node = make_store("node", origin=nginx.url, memory_dir=None, disk_capacity=int(a.stat().st_size * 1.5))
    node.pull("a:1")
    node.pull("b:1")
    assert node.disk.usage().used <= node.disk.capacity  # type: ignore[operator]
    assert mismatches(load_file(a), dict(open_tensors("a:1", store=node).items())) == []  # refetched


def test_flipped_byte_in_memory_tier_is_detected_and_refetched(
    make_store: Callable[..., WeightStore], checkpoint_dir: Path
) -> None:
    store = make_store()
    store.push(checkpoint_dir, "m:1")
    store.pull("m:1")
    store.flush()
    assert store.memory is not None
    digest = _biggest(store, "m:1")
    _flip(store.memory.path(digest))
    tensors = open_tensors("m:1", store=store)
    assert mismatches(load_file(checkpoint_dir / "model.safetensors"), dict(tensors.items())) == []
    assert store.memory.usage().corrupt_detected == 1


def test_flipped_byte_on_disk_is_refetched_from_origin(
    make_store: Callable[..., WeightStore], checkpoint_dir: Path, nginx: NginxOrigin
) -> None:
    make_store("pub", root=nginx.root, memory_dir=None).push(checkpoint_dir, "m:1")
    node = make_store("node", origin=nginx.url, memory_dir=None)
    node.pull("m:1")
    digest = _biggest(node, "m:1")
    _flip(node.disk.path(digest))
    fetched = len([p for p in nginx.requests() if digest in p])
    tensors = open_tensors("m:1", store=node)
    assert mismatches(load_file(checkpoint_dir / "model.safetensors"), dict(tensors.items())) == []
    assert node.disk.usage().corrupt_detected == 1
    assert len([p for p in nginx.requests() if digest in p]) > fetched


def test_corrupt_chunk_with_no_good_copy_names_model_and_chunk(
    make_store: Callable[..., WeightStore], checkpoint_dir: Path, nginx: NginxOrigin
) -> None:
    publisher = make_store("pub", root=nginx.root, memory_dir=None)
    publisher.push(checkpoint_dir, "m:1")
    digest = _biggest(publisher, "m:1")
    _flip(publisher.disk.path(digest))  # the origin itself now serves bad bytes
    node = make_store("node", origin=nginx.url)
    tensors = open_tensors("m:1", store=node, prefetch=False)
    name = next(n for n, e in node.manifest("m:1").tensor_chunks().items() if e is not None and e.digest == digest)
    with pytest.raises(ChunkCorrupt, match=f"model m:1: chunk {digest}"):
        tensors[name]
    assert not os.path.exists(node.disk.path(digest))
    assert node.memory is not None and not os.path.exists(node.memory.path(digest))


def test_origin_down_is_a_clear_error_and_local_tiers_keep_serving(
    make_store: Callable[..., WeightStore], checkpoint_dir: Path, tmp_path: Path, nginx: NginxOrigin
) -> None:
    publisher = make_store("pub", root=nginx.root, memory_dir=None)
    publisher.push(checkpoint_dir, "m:1")
    other = write_checkpoint(tmp_path / "other" / "model.safetensors", small_specs(seed=9))
    publisher.push(other.parent, "other:1")
    node = make_store("node", origin=nginx.url, origin_timeout_s=2)
    node.pull("m:1")
    node.manifest("other:1")  # manifest is local, its chunks are not
    nginx.stop()
    expected = load_file(checkpoint_dir / "model.safetensors")
    assert mismatches(expected, dict(open_tensors("m:1", store=node).items())) == []
    with pytest.raises(TierUnavailable, match=f"origin {nginx.url} is unreachable"):
        node.pull("other:1")
    with pytest.raises(TierUnavailable, match="unreachable"):
        node.manifest("never:1")


def test_pull_returns_once_on_disk_and_the_memory_tier_fills_behind(
    make_store: Callable[..., WeightStore], checkpoint_dir: Path, nginx: NginxOrigin
) -> None:
    make_store("pub", root=nginx.root, memory_dir=None).push(checkpoint_dir, "m:1")
    node = make_store("node", origin=nginx.url)
    assert node.memory is not None
    node.pause_fills()  # as a start in flight on the node does
    chunks = list(node.pull("m:1").unique_chunks().values())
    assert set(node.locate(chunks).values()) == {node.disk}  # verified on disk, nothing in memory yet
    assert not {c.digest for c in chunks} & node.memory.digests()
    node.resume_fills()
    node.flush()
    assert set(node.locate(chunks).values()) == {node.memory}


def test_fill_copies_a_models_chunks_from_disk_to_memory(
    make_store: Callable[..., WeightStore], checkpoint_dir: Path
) -> None:
    store = make_store(promote_from_disk=False)
    store.push(checkpoint_dir, "m:1")  # pushed chunks land on disk only
    chunks = list(store.manifest("m:1").unique_chunks().values())
    store.fill("m:1")
    store.flush()
    assert store.memory is not None and {c.digest for c in chunks} <= store.memory.digests()


def test_fetched_chunks_are_trusted_in_this_boot_and_hashed_again_in_another(
    make_store: Callable[..., WeightStore], checkpoint_dir: Path, nginx: NginxOrigin
) -> None:
    """A fetched chunk lands without fsync (it can be fetched again): a crash of the machine could leave it torn
    behind an unchanged stamp, so its index row names the boot that wrote it and another boot hashes it again."""
    make_store("pub", root=nginx.root, memory_dir=None).push(checkpoint_dir, "m:1")
    node = make_store("node", origin=nginx.url, memory_dir=None)
    digests = list(node.pull("m:1").unique_chunks())
    index = node.disk._index
    assert set(index.stamps(digests, BOOT_ID)) == set(digests)
    assert index.stamps(digests, "another boot") == {}
    pushed = make_store("pusher", memory_dir=None)   # fsync on: pushed chunks are synced and trusted in any boot
    pushed.push(checkpoint_dir, "m:1")
    assert set(pushed.disk._index.stamps(digests, "another boot")) == set(digests)
