"""Fixtures for end-to-end tests: real `ember serve` processes and real clients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ember.testing.server import EmberServer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"


@pytest.fixture(scope="module")
def examples_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmberServer]:
    """The bundled examples (MiniLM, iris and SmolLM2), as a newcomer's `ember serve` runs them."""
    with EmberServer(tmp_path_factory.mktemp("examples")) as server:
        yield server
