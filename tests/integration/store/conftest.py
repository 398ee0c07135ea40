"""Fixtures for the store tests: a real nginx origin on loopback, synthetic checkpoints, stores in temp dirs."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ember.store import StoreConfig, WeightStore
from ember.store.tiers.peer import FetchGate, PeerDirectory
from ember.testing import models
from ember.testing.checkpoints import small_specs, write_checkpoint
from ember.testing.nginx import NginxOrigin, available


@pytest.fixture
def checkpoint_dir(tmp_path: Path) -> Path:
    """A small model directory: a safetensors checkpoint (a few MB) and two JSON files."""
    d = tmp_path / "model"
    write_checkpoint(d / "model.safetensors", small_specs(seed=1))
    (d / "config.json").write_text('{"hidden_size": 256}')
    (d / "tokenizer.json").write_text('{"vocab": ["a", "b"]}')
    return d


@pytest.fixture
def minilm_dir() -> Path:
    return models.minilm_dir()


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[..., WeightStore]]:
    """Build stores whose root and memory tier live under tmp_path (memory tier on /dev/shm when present)."""
    made: list[WeightStore] = []
    shm_dirs: list[Path] = []

    def make(name: str = "node", *, directory: PeerDirectory | None = None, gate: FetchGate | None = None,
             **overrides: Any) -> WeightStore:
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
        shm = base / f"ember-test-{os.getpid()}-{tmp_path.name}-{name}"
        shm_dirs.append(shm)
        values: dict[str, Any] = {"root": tmp_path / name, "memory_dir": shm, "threads": 4, "part_size": 1 << 20}
        values.update(overrides)
        store = WeightStore(StoreConfig(**values), peers=directory, gate=gate)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
    for shm in shm_dirs:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
def origin_root(tmp_path: Path) -> Path:
    root = tmp_path / "origin"
    root.mkdir()
    return root


@pytest.fixture
def nginx(origin_root: Path) -> Iterator[NginxOrigin]:
    if not available():
        pytest.fail("nginx is not installed: run `make system` (apt-get install nginx-light)")
    origin = NginxOrigin(origin_root, slow_rate="2m")
    origin.start()
    yield origin
    origin.close()
