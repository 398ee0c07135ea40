"""Fixtures shared by the integration tests."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def llm_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A weight-store root for the llm runtime's tests: the bundled GGUF is converted into it (under converted/)
    by the first test that loads it, once per session, and the ~540 MB conversion is removed afterwards."""
    root = tmp_path_factory.mktemp("llm-store")
    yield root
    shutil.rmtree(root, ignore_errors=True)
