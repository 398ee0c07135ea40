"""The job store under faults: damaged files (real SQLite files corrupted on purpose), a full disk
(SQLite's max_page_count: writes fail with SQLITE_FULL), leases, idempotency keys and file modes."""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ember.errors import IdempotencyConflict, JobNotFound, JobStoreError
from ember.jobs.store import JobStore

WALL0 = 1_700_000_000.0


class Wall:
    def __init__(self, t: float = WALL0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def big(i: int = 0, n: int = 4096) -> dict[str, np.ndarray]:
    return {"x": np.full(n, i, dtype=np.float32)}


def store(path: Path, wall: Wall | None = None, **kw: object) -> JobStore:
    return JobStore(path, max_queued=1000, result_ttl_s=60.0, wall=wall or Wall(), **kw)  # type: ignore[arg-type]


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """A closed job database holding 20 queued jobs (16 KiB of inputs each: many pages)."""
    path = tmp_path / "jobs.sqlite3"
    with store(path) as s:
        for i in range(20):
            s.submit("m", "1", big(i))
    return path


@pytest.fixture
def errors(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.ERROR, logger="ember.jobs")
    yield caplog


def moved_aside(path: Path) -> list[Path]:
    return sorted(p for p in path.parent.iterdir() if ".damaged-" in p.name)


def assert_fresh_store_took_over(path: Path) -> None:
    with store(path) as s:
        assert s.queued_count() == 0
        job_id = s.submit("m", "1", big())
        claimed = s.claim_next()
        assert claimed is not None and claimed.id == job_id


def test_garbage_pages_are_found_at_start_and_the_file_moved_aside(
        db: Path, errors: pytest.LogCaptureFixture) -> None:
    with db.open("r+b") as f:
        f.seek(4096 * 4)
        f.write(os.urandom(4096 * 6))
    assert_fresh_store_took_over(db)
    (aside,) = moved_aside(db)
    assert aside.name.startswith("jobs.sqlite3.damaged-2023") and aside.stat().st_size > 0   # kept for forensics
    (line,) = [r.getMessage() for r in errors.records]
    assert "is damaged" in line and str(aside) in line and "fresh job store takes over" in line
    assert "malformed" in line or "quick_check" in line


def test_a_zero_length_file_is_not_silently_reused(db: Path, errors: pytest.LogCaptureFixture) -> None:
    db.write_bytes(b"")
    assert_fresh_store_took_over(db)
    (aside,) = moved_aside(db)
    assert aside.stat().st_size == 0
    (line,) = [r.getMessage() for r in errors.records]
    assert "empty (zero bytes)" in line and "whatever it held is lost" in line


def test_a_corrupted_header_is_moved_aside_instead_of_stopping_the_server(
        db: Path, errors: pytest.LogCaptureFixture) -> None:
    with db.open("r+b") as f:
        f.write(b"\xde\xad" * 50)
    assert_fresh_store_took_over(db)
    assert len(moved_aside(db)) == 1
    assert "file is not a database" in errors.records[0].getMessage()


def test_a_foreign_table_is_moved_aside_with_the_count_of_what_it_held(
        tmp_path: Path, errors: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "jobs.sqlite3"
    with sqlite3.connect(path) as raw:
        raw.execute("CREATE TABLE jobs (id TEXT, state TEXT)")
        raw.executemany("INSERT INTO jobs VALUES (?, ?)", [("a", "queued"), ("b", "queued"), ("c", "running")])
    raw.close()
    assert_fresh_store_took_over(path)
    line = errors.records[0].getMessage()
    assert "the jobs table lacks" in line and "it held 3 job(s) (2 queued, 1 running)" in line


def test_a_file_of_the_previous_schema_keeps_its_jobs(tmp_path: Path, errors: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "jobs.sqlite3"
    old_schema = """CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
        model TEXT NOT NULL, version TEXT NOT NULL, state TEXT NOT NULL, inputs BLOB NOT NULL, outputs BLOB,
        error TEXT, created_at REAL NOT NULL, finished_at REAL)"""
    with store(tmp_path / "donor.sqlite3") as donor:   # a job blob as the store writes it
        donor.submit("m", "1", big(7))
    with sqlite3.connect(tmp_path / "donor.sqlite3") as src:
        row = src.execute("SELECT id, model, version, state, inputs, created_at FROM jobs").fetchone()
    src.close()
    with sqlite3.connect(path) as raw:
        raw.execute(old_schema)
        raw.execute("INSERT INTO jobs (id, model, version, state, inputs, created_at) VALUES (?,?,?,?,?,?)", row)
    raw.close()
    with store(path) as s:
        claimed = s.claim_next()
        assert claimed is not None and claimed.id == row[0] and claimed.inputs["x"][0] == 7
    assert not errors.records and not moved_aside(path)


def test_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        with store(tmp_path / "jobs.sqlite3") as s:
            s.submit("m", "1", big())
            names = ["jobs.sqlite3", "jobs.sqlite3-wal", "jobs.sqlite3-shm"]
            assert {n: stat.S_IMODE((tmp_path / n).stat().st_mode) for n in names} == dict.fromkeys(names, 0o600)
        loose = tmp_path / "loose.sqlite3"
        store(loose).close()
        loose.chmod(0o644)
        store(loose).close()   # an existing file is tightened
        assert stat.S_IMODE(loose.stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_a_full_disk_is_a_job_store_error_naming_no_path_and_passes(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    with store(path) as s:
        s.submit("m", "1", big())
        job = s.claim_next()
        assert job is not None
        s.set_max_bytes(path.stat().st_size)        # the disk is full from here
        with pytest.raises(JobStoreError, match="database or disk is full") as err:
            for i in range(10):
                s.submit("m", "1", big(i))
        assert str(tmp_path) not in err.value.message and err.value.retry_after > 0
        assert s.get(job.id).state == "running"      # reads still work
        with pytest.raises(JobStoreError, match="disk is full"):
            s.complete(job.id, big(1, 16384))        # the result cannot be written: the job stays running
        assert s.get(job.id).state == "running"
        s.set_max_bytes(None)                        # space again
        s.complete(job.id, big(1, 16384))
        assert s.get(job.id).state == "succeeded"


def test_a_lease_that_runs_out_puts_the_job_back_in_its_place(tmp_path: Path) -> None:
    wall = Wall()
    path = tmp_path / "jobs.sqlite3"
    with store(path, wall, owner="gone") as dead, store(path, wall, owner="alive") as live:
        first, second = live.submit("m", "1", big(1)), live.submit("m", "1", big(2))
        assert dead.claim_next().id == first and live.claim_next().id == second  # type: ignore[union-attr]
        wall.t += 50
        assert live.renew([first, second]) == 1      # only its own claim: `first` is the dead worker's
        assert live.reclaim_expired(60.0) == 0
        wall.t += 50                                 # `first`: 100 s since its claim; `second`: 50 since renewed
        assert live.reclaim_expired(60.0) == 1
        assert live.get(first).state == "queued" and live.get(second).state == "running"
        assert live.claim_next().id == first  # type: ignore[union-attr]   # its place in line is kept
        with pytest.raises(JobNotFound):
            dead.requeue("0" * 32)


def test_an_idempotency_key_returns_the_same_job_until_its_result_expires(tmp_path: Path) -> None:
    wall = Wall()
    with store(tmp_path / "jobs.sqlite3", wall) as s:
        job_id = s.submit("m", "1", big(1), idempotency_key="order-42")
        assert s.submit("m", "1", big(1), idempotency_key="order-42") == job_id
        assert s.existing("m", "1", "order-42", big(1)) == job_id and s.queued_count() == 1
        assert s.existing("m", "1", "order-43", big(1)) is None
        other_model = s.submit("n", "1", big(1), idempotency_key="order-42")    # keys are per model
        assert other_model != job_id
        with pytest.raises(IdempotencyConflict, match="Idempotency-Key: already used for job"):
            s.submit("m", "1", big(2), idempotency_key="order-42")
        s.claim_next(["m"])
        s.complete(job_id, big(3))
        wall.t += 59
        assert s.submit("m", "1", big(1), idempotency_key="order-42") == job_id   # the result still lives
        wall.t += 1                                                                 # ... and now expired
        assert s.existing("m", "1", "order-42", big(1)) is None
        fresh = s.submit("m", "1", big(2), idempotency_key="order-42")
        assert fresh != job_id and s.get(fresh).state == "queued"
