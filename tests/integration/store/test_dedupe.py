"""Identical tensors are stored once across models, even when their offsets differ."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ember.store import WeightStore, open_tensors
from ember.testing.checkpoints import fine_tune, mismatches, small_specs, write_checkpoint


def test_fine_tune_costs_only_its_new_bytes(make_store: Callable[..., WeightStore], tmp_path: Path) -> None:
    base_specs = small_specs(seed=5, layers=6)
    base = write_checkpoint(tmp_path / "base" / "model.safetensors", base_specs)
    tuned = write_checkpoint(tmp_path / "tuned" / "model.safetensors", fine_tune(base_specs, 0.10))
    store = make_store()
    store.push(base.parent, "base:1")
    before = store.stats()
    store.push(tuned.parent, "tuned:1")
    after = store.stats()
    added = after.unique_bytes - before.unique_bytes
    assert base.stat().st_size * 0.05 < added <= base.stat().st_size * 0.12
    disk_before = next(t for t in before.tiers if t.name == "disk").used
    disk_after = next(t for t in after.tiers if t.name == "disk").used
    assert disk_after - disk_before == added
    assert after.dedupe_ratio > 1.7
    from safetensors.torch import load_file

    assert mismatches(load_file(tuned), dict(open_tensors("tuned:1", store=store).items())) == []
    assert mismatches(load_file(base), dict(open_tensors("base:1", store=store).items())) == []


def test_pushing_twice_adds_nothing(make_store: Callable[..., WeightStore], checkpoint_dir: Path) -> None:
    store = make_store()
    store.push(checkpoint_dir, "a:1")
    used = store.stats().unique_bytes
    store.push(checkpoint_dir, "a:2")
    stats = store.stats()
    assert stats.unique_bytes == used
    assert next(t for t in stats.tiers if t.name == "disk").used == used
