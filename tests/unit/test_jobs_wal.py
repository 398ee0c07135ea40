"""WAL damage in the job store: a server killed with jobs only in the WAL leaves it behind; truncated, overwritten
with garbage or with a bad header, its loss used to be silent (102 of 200 acknowledged jobs, `job_store: ok`).
Now it is found before SQLite replays it, reported with counts, and the WAL is kept."""

from __future__ import annotations

import logging
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from ember.jobs.store import JobStore
from ember.jobs.wal import check_wal

N = 200


def crashed_store(tmp_path: Path) -> tuple[Path, list[str]]:
    """The files a server SIGKILLed with N acknowledged jobs leaves: the database, its WAL and its wal-index
    (copied while the store is open, so nothing was checkpointed into the database)."""
    live = tmp_path / "live"
    live.mkdir()
    s = JobStore(live / "jobs.sqlite3", max_queued=10_000, result_ttl_s=60)
    ids = [s.submit("m", "1", {"x": np.full(4, i, np.float32)}) for i in range(N)]
    dead = tmp_path / "dead"
    dead.mkdir()
    for name in ("jobs.sqlite3", "jobs.sqlite3-wal", "jobs.sqlite3-shm"):
        shutil.copy2(live / name, dead / name)
    s.close()
    return dead / "jobs.sqlite3", ids


def present(path: Path, ids: list[str]) -> int:
    with JobStore(path, max_queued=10_000, result_ttl_s=60) as s:
        return sum(1 for i in ids if _exists(s, i))


def _exists(s: JobStore, job_id: str) -> bool:
    try:
        s.get(job_id)
        return True
    except Exception:
        return False


@pytest.fixture
def errors(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.ERROR, logger="ember.jobs")
    return caplog


def test_a_sound_wal_after_a_crash_replays_every_job_and_says_nothing(
        tmp_path: Path, errors: pytest.LogCaptureFixture) -> None:
    path, ids = crashed_store(tmp_path)
    assert (path.with_name("jobs.sqlite3-wal")).stat().st_size > 100_000 and check_wal(path) is None
    assert present(path, ids) == N and not errors.records


def _corrupt(path: Path, how: str) -> None:
    wal = path.with_name(path.name + "-wal")
    data = bytearray(wal.read_bytes())
    page = int.from_bytes(data[8:12], "big")
    frame = 24 + page
    if how == "garbage":                         # 4 KiB of garbage in the middle
        middle = 32 + (len(data) - 32) // frame // 2 * frame + 100
        data[middle:middle + 4096] = np.random.default_rng(1).bytes(4096)
    elif how == "truncated":                     # cut in the middle of a frame
        del data[32 + (len(data) - 32) // frame // 2 * frame + 1000:]
    elif how == "truncated at a frame boundary":  # leaves a sound but shorter WAL: only the wal-index knows
        del data[32 + (len(data) - 32) // frame // 2 * frame:]
    elif how == "bad header":
        data[0:4] = b"\0\0\0\0"
    wal.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["garbage", "truncated", "truncated at a frame boundary", "bad header"])
def test_wal_damage_is_reported_with_counts_and_the_wal_kept(
        tmp_path: Path, errors: pytest.LogCaptureFixture, how: str) -> None:
    path, ids = crashed_store(tmp_path)
    original_wal = path.with_name("jobs.sqlite3-wal").read_bytes()
    _corrupt(path, how)
    damaged_wal = path.with_name("jobs.sqlite3-wal").read_bytes()
    damage = check_wal(path)
    assert damage is not None and damage.lost_frames > 0, how
    with JobStore(path, max_queued=10_000, result_ttl_s=60) as s:
        assert s.damage is not None and "cannot be replayed" in s.damage
        assert s.damage.startswith(f"job store {path}:")
        found = sum(1 for i in ids if _exists(s, i))
        s.submit("m", "1", {"x": np.zeros(4, np.float32)})   # the store works on
    lost = N - found
    assert lost > 0, how                                        # the loss is real ...
    lines = [r.getMessage() for r in errors.records if "cannot be replayed" in r.getMessage()]
    assert len(lines) == 1 and f"{damage.lost_frames} frame(s)" in lines[0]   # ... and said, once, with counts
    if damage.lost_commits is not None:
        assert damage.lost_commits >= lost    # each lost submission was a commit past the last good frame
    kept = [p for p in path.parent.iterdir() if p.name.startswith("jobs.sqlite3-wal.damaged-")]
    assert len(kept) == 1 and kept[0].read_bytes() == damaged_wal and kept[0].stat().st_mode & 0o777 == 0o600
    assert str(kept[0]) in lines[0]
    assert original_wal != damaged_wal
    said = len(errors.records)     # a bad header: the database, its schema only in the WAL, is moved aside too
    assert present(path, ids) == found and len(errors.records) == said   # reopened: nothing new to say


def test_the_server_status_says_the_store_was_damaged(tmp_path: Path) -> None:
    path, _ = crashed_store(tmp_path)
    _corrupt(path, "garbage")
    with JobStore(path, max_queued=10_000, result_ttl_s=60) as s:
        assert s.damage is not None
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"   # the good prefix replayed cleanly
    conn.close()


def test_a_wal_cut_at_a_frame_boundary_says_it_is_shorter_than_its_index(tmp_path: Path) -> None:
    path, _ = crashed_store(tmp_path)
    _corrupt(path, "truncated at a frame boundary")
    damage = check_wal(path)
    assert damage is not None
    assert damage.reason.startswith("the WAL is shorter than its index says: ") and "than;" not in damage.reason
    assert f"{damage.lost_frames + damage.good_frames} frame(s) were committed, {damage.good_frames} are there" \
        in damage.reason
    with JobStore(path, max_queued=10_000, result_ttl_s=60) as s:
        assert s.damage is not None and f"SQLite replays its {damage.good_frames} good frame(s)" in s.damage


def test_a_zero_length_wal_is_reported_as_truncated_not_as_a_foreign_file(tmp_path: Path,
                                                                          errors: pytest.LogCaptureFixture) -> None:
    """The WAL of a killed server cut to zero bytes: everything, the jobs table included, was in it. Was reported
    only as "no jobs table: not ember's job database"."""
    path, ids = crashed_store(tmp_path)
    path.with_name("jobs.sqlite3-wal").write_bytes(b"")
    damage = check_wal(path)
    assert damage is not None and damage.lost_frames > 0 and damage.good_frames == 0
    assert damage.reason.startswith(f"the WAL is empty (zero bytes), yet its index says {damage.lost_frames} "
                                    "frame(s) were committed")
    with JobStore(path, max_queued=10_000, result_ttl_s=60) as s:
        assert s.damage is not None and "nothing in it can be replayed" in s.damage
        assert "not ember's job database" not in s.damage
        assert "no jobs table: the file holds no table and is in WAL mode" in s.damage
        assert "its WAL, which is empty (zero bytes)" in s.damage
        assert not any(_exists(s, i) for i in ids)
    assert len(errors.records) == 2   # the WAL's damage, then the file moved aside


@pytest.mark.parametrize("wal", ["empty", "missing"])
def test_a_file_whose_writes_were_all_in_a_lost_wal_says_so(tmp_path: Path, wal: str) -> None:
    """No wal-index either: the file alone says it is in WAL mode and holds no table."""
    path, _ = crashed_store(tmp_path)
    path.with_name("jobs.sqlite3-shm").unlink()
    if wal == "empty":
        path.with_name("jobs.sqlite3-wal").write_bytes(b"")
    else:
        path.with_name("jobs.sqlite3-wal").unlink()
    assert check_wal(path) is None   # nothing left to say how much was lost
    with JobStore(path, max_queued=10_000, result_ttl_s=60) as s:
        assert s.damage is not None
        assert f"its WAL, which is {'empty (zero bytes)' if wal == 'empty' else 'missing'}" in s.damage


def test_a_file_with_tables_but_no_jobs_table_is_still_not_embers(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE other (x)")
    conn.commit()
    conn.close()
    with JobStore(path, max_queued=10, result_ttl_s=60) as s:
        assert s.damage is not None and "no jobs table: not ember's job database" in s.damage
