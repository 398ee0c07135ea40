"""A model's copy in the memory tier released (its keep-alive plan keeps nothing): disk stays, shared chunks stay."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file

from ember.store import WeightStore, open_tensors
from ember.testing.checkpoints import fine_tune, mismatches, small_specs, write_checkpoint


def _filled(store: WeightStore, *models: str) -> None:
    for model in models:
        store.fill(model)
    store.flush()


def _digests(store: WeightStore, model: str) -> set[str]:
    return set(store.manifest(model).unique_chunks())


def _sizes(store: WeightStore, model: str, digests: set[str]) -> int:
    return sum(c.size for d, c in store.manifest(model).unique_chunks().items() if d in digests)


def test_release_frees_the_models_chunks_keeps_the_shared_ones_and_a_later_load_reads_disk(
        make_store: Callable[..., WeightStore], tmp_path: Path) -> None:
    base_specs = small_specs(seed=5, layers=6)
    base = write_checkpoint(tmp_path / "base" / "model.safetensors", base_specs)
    tuned = write_checkpoint(tmp_path / "tuned" / "model.safetensors", fine_tune(base_specs, 0.25))
    store = make_store()
    store.push(base.parent, "base:1")
    store.push(tuned.parent, "tuned:1")
    _filled(store, "base:1", "tuned:1")
    assert store.memory is not None
    shared = _digests(store, "base:1") & _digests(store, "tuned:1")
    own = _digests(store, "tuned:1") - shared
    assert shared and own and _digests(store, "tuned:1") <= store.memory.digests()
    before = store.memory.usage().used

    freed = store.release_memory("tuned:1", keep=_digests(store, "base:1"))

    assert freed == _sizes(store, "tuned:1", own) > 0
    assert store.memory.usage().used == before - freed       # the tier's index counts them gone
    assert not own & store.memory.digests() and shared <= store.memory.digests()
    assert _digests(store, "tuned:1") <= store.disk.digests()  # the disk copy stays
    assert store.release_memory("tuned:1", keep=_digests(store, "base:1")) == 0
    # A load after the release reads the released chunks from disk, bit for bit; a fill brings them back.
    tensors = open_tensors("tuned:1", store=store).wait()
    assert mismatches(load_file(tuned), dict(tensors.items())) == []
    tensors.close()
    _filled(store, "tuned:1")
    assert own <= store.memory.digests()


def test_a_chunk_mapped_by_a_live_reader_stays_valid_after_the_release(
        make_store: Callable[..., WeightStore], checkpoint_dir: Path) -> None:
    store = make_store()
    store.push(checkpoint_dir, "m:1")
    _filled(store, "m:1")
    assert store.memory is not None
    tensors = open_tensors("m:1", store=store, prefetch=False)
    views = dict(tensors.items())   # mapped from the memory tier's files
    assert store.release_memory("m:1") > 0
    assert not _digests(store, "m:1") & store.memory.digests()
    # The files are unlinked, the mappings still hold their pages (freed once the reader unmaps them).
    deleted = [line for line in Path("/proc/self/maps").read_text().splitlines()
               if str(store.memory.directory) in line and line.endswith("(deleted)")]
    assert deleted
    assert mismatches(load_file(checkpoint_dir / "model.safetensors"), views) == []


def test_a_copy_up_queued_before_the_release_is_skipped(
        make_store: Callable[..., WeightStore], checkpoint_dir: Path) -> None:
    store = make_store()
    store.push(checkpoint_dir, "m:1")
    assert store.memory is not None
    store.pause_fills()            # as a load in flight does: the fill is queued, not run
    store.fill("m:1")
    assert store.release_memory("m:1") == 0
    store.resume_fills()
    store.flush()
    assert not _digests(store, "m:1") & store.memory.digests()
    _filled(store, "m:1")          # asked again after the release: it runs
    assert _digests(store, "m:1") <= store.memory.digests()
