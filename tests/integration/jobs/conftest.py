"""Fixtures for the job-queue tests: each test runs against both stores, the SQLite file and a real PostgreSQL
server (Debian's package, started once per session on loopback by `ember.testing.postgres`)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ember.jobs.store import JobStore
from ember.testing import postgres

Store = Any   # JobStore | PgJobStore: both satisfy ember.serving.ports.JobQueue


class Wall:
    """A settable wall clock (unix seconds) for the stores' `wall` parameter."""

    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def pg_url(pg_server: postgres.PostgresServer) -> str:
    """A fresh database of its own for one test."""
    return pg_server.create_database(f"t_{uuid.uuid4().hex[:12]}")


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_store(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Store]]:
    """Stores on one shared database (several of them: several nodes). `wall`, `owner`, `node`, `max_queued`,
    `result_ttl_s` as the stores take them (`node`: the PostgreSQL store only)."""
    made: list[Store] = []
    url = request.getfixturevalue("pg_url") if backend == "postgres" else None

    def make(wall: Wall | None = None, *, max_queued: int = 100, result_ttl_s: float = 60.0, **kw: Any) -> Store:
        args: dict[str, Any] = {"max_queued": max_queued, "result_ttl_s": result_ttl_s, "wall": wall or Wall(), **kw}
        if url is None:
            args.pop("node", None)
            store: Store = JobStore(tmp_path / "jobs.sqlite3", **args)
        else:
            from ember.jobs.postgres import PgJobStore

            store = PgJobStore(url, **args)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
