"""The durable job store: persistence, atomic claims, TTL, the queue limit, error translation."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import numpy as np
import pytest

from ember.errors import InvalidInput, JobNotFound, Overloaded
from ember.jobs.store import JobStore, JobStoreError
from ember.wire import bundle


class Wall:
    """A settable wall clock (unix seconds) for the store's `wall` parameter."""

    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def texts(*items: bytes) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = list(items)
    return arr


def inputs(i: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.full((2, 3), i, dtype=np.float32), "text": texts(b"job", str(i).encode())}


def store(path: Path, wall: Wall | None = None, **kw: float) -> JobStore:
    args = {"max_queued": 100, "result_ttl_s": 60.0, **kw}
    return JobStore(path, max_queued=int(args["max_queued"]), result_ttl_s=float(args["result_ttl_s"]),
                    wall=wall or Wall())


def test_tensor_blob_round_trip() -> None:
    t = inputs(7)
    back = bundle.unpack(bundle.pack(t), "job")
    assert list(back) == ["x", "text"]
    assert np.array_equal(back["x"], t["x"]) and back["x"].dtype == np.float32
    assert list(back["text"]) == [b"job", b"7"]


def test_lifecycle_queued_running_succeeded(tmp_path: Path) -> None:
    wall = Wall()
    with store(tmp_path / "j.sqlite3", wall) as s:
        job_id = s.submit("affine", "1", inputs(1))
        assert len(job_id) == 32 and int(job_id, 16) >= 0
        st = s.get(job_id)
        assert (st.state, st.model, st.version) == ("queued", "affine", "1")
        assert (st.created_at, st.finished_at) == (wall.t, None)
        claimed = s.claim_next()
        assert claimed is not None and claimed.id == job_id
        assert np.array_equal(claimed.inputs["x"], inputs(1)["x"])
        assert s.get(job_id).state == "running"
        wall.t += 5
        s.complete(job_id, {"y": np.arange(3, dtype=np.float32)})
        done = s.get(job_id)
        assert done.state == "succeeded" and done.finished_at == wall.t
        assert done.outputs is not None and list(done.outputs["y"]) == [0.0, 1.0, 2.0]
        with pytest.raises(JobNotFound, match="no such running job"):
            s.complete(job_id, {})


def test_fail_records_the_error(tmp_path: Path) -> None:
    with store(tmp_path / "j.sqlite3") as s:
        job_id = s.submit("m", "1", inputs())
        s.claim_next()
        s.fail(job_id, "model 'm:1': infer() failed: ValueError")
        st = s.get(job_id)
        assert st.state == "failed" and st.error == "model 'm:1': infer() failed: ValueError" and st.outputs is None


def test_claims_oldest_first_and_by_model(tmp_path: Path) -> None:
    with store(tmp_path / "j.sqlite3") as s:
        a = s.submit("a", "1", inputs(1))
        b = s.submit("b", "2", inputs(2))
        a2 = s.submit("a", "1", inputs(3))
        assert s.claim_next(["b"]).id == b  # type: ignore[union-attr]
        assert s.claim_next(["nothing"]) is None
        assert s.claim_next([]) is None
        assert s.claim_next(["a:1"]).id == a  # type: ignore[union-attr]   # "name:version" keys work too
        assert s.claim_next().id == a2  # type: ignore[union-attr]
        assert s.claim_next() is None


def test_requeue_keeps_the_place_in_line(tmp_path: Path) -> None:
    with store(tmp_path / "j.sqlite3") as s:
        first = s.submit("m", "1", inputs(1))
        s.submit("m", "1", inputs(2))
        assert s.claim_next().id == first  # type: ignore[union-attr]
        s.requeue(first)
        assert s.get(first).state == "queued"
        assert s.claim_next().id == first  # type: ignore[union-attr]
        with pytest.raises(JobNotFound):
            s.requeue("0" * 32)


def test_survives_reopen_and_requeues_running(tmp_path: Path) -> None:
    path = tmp_path / "state" / "jobs.sqlite3"
    s = store(path)
    queued = s.submit("m", "1", inputs(1))
    running = s.submit("m", "1", inputs(2))
    s.claim_next()  # claims `queued`, the oldest
    s.close()
    reopened = store(path)
    assert reopened.queued_count() == 1
    assert reopened.get(queued).state == "running"
    assert reopened.requeue_running() == 1
    assert reopened.queued_count() == 2
    assert [reopened.claim_next().id, reopened.claim_next().id] == [queued, running]  # type: ignore[union-attr]
    reopened.close()


def test_directory_path_gets_the_default_file(tmp_path: Path) -> None:
    with store(tmp_path) as s:
        s.submit("m", "1", inputs())
    assert (tmp_path / "jobs.sqlite3").is_file()


def test_max_queued_raises_overloaded_with_retry_after(tmp_path: Path) -> None:
    with store(tmp_path / "j.sqlite3", max_queued=2) as s:
        s.submit("m", "1", inputs())
        s.submit("m", "1", inputs())
        with pytest.raises(Overloaded, match=r"max_queued 2") as err:
            s.submit("m", "1", inputs())
        assert err.value.retry_after > 0
        s.claim_next()  # a running job no longer counts against the queue
        s.submit("m", "1", inputs())
        assert s.queued_count() == 2 and s.queued_count("m") == 2 and s.queued_count("other") == 0


def test_ttl_hides_then_expire_deletes_finished_jobs(tmp_path: Path) -> None:
    wall = Wall()
    with store(tmp_path / "j.sqlite3", wall, result_ttl_s=30.0) as s:
        done = s.submit("m", "1", inputs(1))
        waiting = s.submit("m", "1", inputs(2))
        s.claim_next()
        s.complete(done, {"y": np.zeros(1, np.float32)})
        wall.t += 29
        assert s.get(done).state == "succeeded"
        assert s.get(done).state == "succeeded"  # fetching does not consume the result
        assert s.expire() == 0
        wall.t += 1
        with pytest.raises(JobNotFound, match="expired"):
            s.get(done)
        assert s.expire() == 1
        assert s.get(waiting).state == "queued"  # unfinished jobs never expire
        wall.t += 10_000
        assert s.expire() == 0 and s.get(waiting).state == "queued"


def test_concurrent_claims_never_share_a_job(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    n = 200
    with store(path, max_queued=n) as s:
        ids = {s.submit("m", "1", inputs(i)) for i in range(n)}
    # Four claimers: two threads on one store object and two on stores of their own (as separate processes would).
    shared = store(path)
    stores = [shared, shared, store(path), store(path)]
    claimed: list[list[str]] = [[] for _ in stores]
    start = threading.Barrier(len(stores))

    def claim(k: int) -> None:
        start.wait()
        while (job := stores[k].claim_next()) is not None:
            claimed[k].append(job.id)

    threads = [threading.Thread(target=claim, args=(k,)) for k in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [j for part in claimed for j in part]
    assert len(every) == len(set(every)) == n and set(every) == ids
    for s in {id(x): x for x in stores}.values():
        s.close()


def test_bad_settings_and_sqlite_failures_are_ember_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="max_queued"):
        JobStore(tmp_path / "j.sqlite3", max_queued=0, result_ttl_s=1)
    with pytest.raises(InvalidInput, match="result_ttl_s"):
        JobStore(tmp_path / "j.sqlite3", max_queued=1, result_ttl_s=0)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    unopenable = store(blocked / "jobs.sqlite3")   # never raises from the constructor: sync serving goes on
    with pytest.raises(JobStoreError, match="job store: open failed") as err:
        unopenable.submit("m", "1", inputs())
    assert str(tmp_path) not in err.value.message and err.value.where == str(blocked / "jobs.sqlite3")
    assert err.value.retry_after > 0
    s = store(tmp_path / "ok.sqlite3")
    s.close()
    with pytest.raises(JobStoreError, match="closed"):
        s.submit("m", "1", inputs())
    assert issubclass(JobStoreError, Exception) and not issubclass(JobStoreError, sqlite3.Error)


def test_a_job_with_unreadable_inputs_fails_at_claim_and_the_next_one_is_claimed(tmp_path: Path) -> None:
    wall = Wall()
    with store(tmp_path / "j.sqlite3", wall) as s:
        bad, good = s.submit("m", "1", inputs(1)), s.submit("m", "1", inputs(2))
        with sqlite3.connect(s.path) as db:
            db.execute("UPDATE jobs SET inputs = x'ffffffff00' WHERE id = ?", (bad,))
        claimed = s.claim_next(["m:1"])
        assert claimed is not None and claimed.id == good
        failed = s.get(bad)
        assert failed.state == "failed" and failed.finished_at == wall.t
        assert failed.error is not None and "unreadable tensors" in failed.error
        assert s.claim_next() is None and s.requeue_running() == 1   # only the good job was running


def test_fail_queued_fails_one_models_waiting_jobs_only(tmp_path: Path) -> None:
    jobs = store(tmp_path / "jobs.db")
    a1, a2, b = jobs.submit("a", "1", inputs()), jobs.submit("a", "2", inputs()), jobs.submit("b", "1", inputs())
    running = jobs.submit("a", "1", inputs())
    assert jobs.queued_models() == {("a", "1"), ("a", "2"), ("b", "1")}
    assert jobs.claim_next(["a:1"]) is not None   # the oldest a:1 job (a1) runs now
    assert jobs.fail_queued("a", "1", "gone") == 1
    assert jobs.get(running).state == "failed" and jobs.get(running).error == "gone"
    assert jobs.get(a1).state == "running" and jobs.get(a2).state == "queued"
    assert jobs.fail_queued("a", None, "gone") == 1 and jobs.get(a2).state == "failed"
    assert jobs.get(b).state == "queued"


def test_a_job_keeps_its_tenant(tmp_path: Path) -> None:
    with JobStore(tmp_path / "j.sqlite3", max_queued=5, result_ttl_s=60) as s:
        assert s.get(s.submit("m", "1", inputs(), tenant="acme")).tenant == "acme"
        assert s.get(s.submit("m", "1", inputs())).tenant is None


def test_a_database_from_before_tenants_gains_the_column(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.executescript("""CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
        model TEXT NOT NULL, version TEXT NOT NULL, state TEXT NOT NULL, inputs BLOB NOT NULL, outputs BLOB,
        error TEXT, created_at REAL NOT NULL, finished_at REAL);
        INSERT INTO jobs (id, model, version, state, inputs, created_at) VALUES ('old', 'm', '1', 'failed', x'', 1);""")
    old.commit()
    old.close()
    with JobStore(path, max_queued=5, result_ttl_s=1e12) as s:
        assert s.get("old").tenant is None
        assert s.get(s.submit("m", "1", inputs(), tenant="acme")).tenant == "acme"
    with JobStore(path, max_queued=5, result_ttl_s=1e12) as s:  # opening again migrates nothing twice
        assert s.get("old").state == "failed"
