"""Fixtures shared by the integration tests."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from ember.testing import postgres


@pytest.fixture(scope="session")
def llm_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A weight-store root for the llm runtime's tests (its prefix snapshots), once per session; removed afterwards
    with its memory tier in /dev/shm (a snapshot store keeps that on close)."""
    root = tmp_path_factory.mktemp("llm-store")
    yield root
    shutil.rmtree(root, ignore_errors=True)
    forget_memory_tier(root)


@pytest.fixture
def store_root(tmp_path: Path) -> Iterator[Path]:
    """An empty weight-store root for one test (its memory tier removed afterwards)."""
    root = tmp_path / "store"
    root.mkdir()
    yield root
    forget_memory_tier(root)


def forget_memory_tier(root: Path) -> None:
    """Remove the weight store's memory tier of `root` (in /dev/shm): snapshot stores keep theirs on close,
    for the instances that share it, so a test's store would outlive the test."""
    from ember.store.config import default_memory_dir

    shm = default_memory_dir(root)
    if shm is not None:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[postgres.PostgresServer]:
    """A real PostgreSQL server (Debian's package) on loopback, once per session; each test makes its databases."""
    if not postgres.available():
        pytest.fail("PostgreSQL is not installed: run `make system` (apt-get install postgresql)")
    with postgres.PostgresServer() as server:
        yield server
