"""The memory tier is RAM (tmpfs): a store removes the directory it created when it closes, unless told to keep
it; a directory it found (a running server's, a template's parent's) is never its to remove."""

from __future__ import annotations

from pathlib import Path

from ember.store import StoreConfig, WeightStore


def test_a_store_removes_the_memory_tier_it_created(tmp_path: Path) -> None:
    memory = tmp_path / "shm" / "ember-store"
    store = WeightStore(StoreConfig(root=tmp_path / "root", memory_dir=memory))
    assert (memory / "chunks").is_dir()
    store.close()
    assert not memory.exists()
    assert (tmp_path / "root").is_dir()   # the disk tier stays
    store.close()   # twice is harmless


def test_a_memory_tier_that_was_there_stays(tmp_path: Path) -> None:
    memory = tmp_path / "ember-store"
    with WeightStore(StoreConfig(root=tmp_path / "root", memory_dir=memory)) as owner:
        with WeightStore(StoreConfig(root=tmp_path / "root", memory_dir=memory)):
            pass
        assert (memory / "chunks").is_dir()   # the second store found it: the first one's to remove
        assert owner.memory is not None
    assert not memory.exists()


def test_keep_memory_tier_leaves_it(tmp_path: Path) -> None:
    memory = tmp_path / "ember-store"
    with WeightStore(StoreConfig(root=tmp_path / "root", memory_dir=memory, keep_memory_tier=True)):
        pass
    assert (memory / "chunks").is_dir()
