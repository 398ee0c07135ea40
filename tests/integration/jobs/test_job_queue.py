"""The job-queue protocol's behaviour, held to by both stores: SQLite (one node) and PostgreSQL (shared by
nodes). Two store objects on one database stand for two nodes (each has its own connection)."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ember.errors import IdempotencyConflict, JobNotFound, Overloaded
from ember.serving.ports import JobQueue

from .conftest import Store, Wall

Make = Callable[..., Store]


def inputs(i: int = 0) -> dict[str, np.ndarray]:
    text = np.empty(2, dtype=object)
    text[:] = [b"job", str(i).encode()]
    return {"x": np.full((2, 3), i, dtype=np.float32), "text": text}


def test_both_stores_satisfy_the_protocol(make_store: Make) -> None:
    store: JobQueue = make_store()
    assert store.queued_count() == 0


def test_lifecycle_queued_running_succeeded(make_store: Make) -> None:
    wall = Wall()
    s = make_store(wall)
    job_id = s.submit("affine", "1", inputs(1))
    st = s.get(job_id)
    assert (st.state, st.model, st.version, st.created_at, st.finished_at) == ("queued", "affine", "1", wall.t, None)
    claimed = s.claim_next()
    assert claimed is not None and claimed.id == job_id and np.array_equal(claimed.inputs["x"], inputs(1)["x"])
    assert list(claimed.inputs["text"]) == [b"job", b"1"]
    assert s.get(job_id).state == "running"
    wall.t += 5
    s.complete(job_id, {"y": np.arange(3, dtype=np.float32)})
    done = s.get(job_id)
    assert done.state == "succeeded" and done.finished_at == wall.t
    assert done.outputs is not None and list(done.outputs["y"]) == [0.0, 1.0, 2.0]
    with pytest.raises(JobNotFound, match="no such running job"):
        s.complete(job_id, {})
    with pytest.raises(JobNotFound):
        s.get("0" * 32)


def test_fail_records_the_error(make_store: Make) -> None:
    s = make_store()
    job_id = s.submit("m", "1", inputs())
    s.claim_next()
    s.fail(job_id, "model 'm:1': infer() failed: ValueError")
    st = s.get(job_id)
    assert st.state == "failed" and st.error == "model 'm:1': infer() failed: ValueError" and st.outputs is None


def test_claims_oldest_first_by_model_and_many_at_once(make_store: Make) -> None:
    s = make_store()
    a = s.submit("a", "1", inputs(1))
    b = s.submit("b", "2", inputs(2))
    a2 = s.submit("a", "1", inputs(3))
    a3 = s.submit("a", "1", inputs(4))
    assert s.claim_next(["b"]).id == b
    assert s.claim_next(["nothing"]) is None and s.claim_next([]) is None
    assert [j.id for j in s.claim(["a:1"], 2)] == [a, a2]     # "name:version" keys work too; oldest first
    assert [j.id for j in s.claim(None, 5)] == [a3]
    assert s.claim() == []


def test_requeue_keeps_the_place_in_line(make_store: Make) -> None:
    s = make_store()
    first = s.submit("m", "1", inputs(1))
    s.submit("m", "1", inputs(2))
    assert s.claim_next().id == first
    s.requeue(first)
    assert s.get(first).state == "queued" and s.claim_next().id == first
    with pytest.raises(JobNotFound):
        s.requeue("0" * 32)


def test_survives_reopen_and_requeues_running(make_store: Make) -> None:
    s = make_store(node="box")
    queued = s.submit("m", "1", inputs(1))
    running = s.submit("m", "1", inputs(2))
    s.claim_next()
    s.close()
    reopened = make_store(node="box")     # the same node's next server
    assert reopened.queued_count() == 1 and reopened.get(queued).state == "running"
    assert reopened.requeue_running() == 1
    assert [reopened.claim_next().id, reopened.claim_next().id] == [queued, running]


def test_max_queued_counts_every_nodes_jobs(make_store: Make) -> None:
    one, two = make_store(max_queued=2), make_store(max_queued=2)
    one.submit("m", "1", inputs())
    two.submit("m", "1", inputs())
    with pytest.raises(Overloaded, match=r"max_queued 2") as err:
        one.submit("m", "1", inputs())
    assert err.value.retry_after > 0
    two.claim_next()    # a running job no longer counts against the queue
    one.submit("m", "1", inputs())
    assert one.queued_count() == 2 and one.queued_count("m") == 2 and two.queued_count("other") == 0


def test_ttl_hides_then_expire_deletes_finished_jobs(make_store: Make) -> None:
    wall = Wall()
    s = make_store(wall, result_ttl_s=30.0)
    done = s.submit("m", "1", inputs(1))
    waiting = s.submit("m", "1", inputs(2))
    s.claim_next()
    s.complete(done, {"y": np.zeros(1, np.float32)})
    wall.t += 29
    assert s.get(done).state == "succeeded" and s.get(done).state == "succeeded"   # fetching consumes nothing
    assert s.expire() == 0
    wall.t += 1
    with pytest.raises(JobNotFound, match="expired"):
        s.get(done)
    assert s.expire() == 1 and s.get(waiting).state == "queued"
    wall.t += 10_000
    assert s.expire() == 0 and s.get(waiting).state == "queued"   # unfinished jobs never expire


def test_two_nodes_claiming_at_once_never_share_a_job(make_store: Make) -> None:
    n = 200
    node_a, node_b = make_store(max_queued=n, owner="a"), make_store(max_queued=n, owner="b")
    ids = {node_a.submit("m", "1", inputs(i)) for i in range(n)}
    claimers = [node_a, node_a, node_b, node_b]     # two threads on each node's store
    claimed: list[list[str]] = [[] for _ in claimers]
    start = threading.Barrier(len(claimers))

    def claim(k: int) -> None:
        start.wait()
        while batch := claimers[k].claim(None, 3):
            claimed[k] += [j.id for j in batch]

    threads = [threading.Thread(target=claim, args=(k,)) for k in range(len(claimers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [j for part in claimed for j in part]
    assert len(every) == len(set(every)) == n and set(every) == ids


def test_a_job_whose_node_died_is_reclaimed_and_runs_on_another(make_store: Make) -> None:
    wall = Wall()
    dead, live = make_store(wall, owner="dead"), make_store(wall, owner="live")
    first, second = live.submit("m", "1", inputs(1)), live.submit("m", "1", inputs(2))
    assert dead.claim_next().id == first and live.claim_next().id == second
    dead.close()                                    # the node dies mid-run
    wall.t += 50
    assert live.renew([first, second]) == 1         # only its own claim: `first` is the dead node's
    assert live.reclaim_expired(60.0) == 0
    wall.t += 50                                    # `first`: 100 s since its claim; `second`: 50 since renewed
    assert live.reclaim_expired(60.0) == 1
    assert live.get(first).state == "queued" and live.get(second).state == "running"
    again = live.claim_next()
    assert again is not None and again.id == first   # its place in line is kept
    live.complete(first, {"y": np.ones(1, np.float32)})
    assert live.get(first).state == "succeeded"


def test_an_idempotency_key_returns_the_same_job_until_its_result_expires(make_store: Make) -> None:
    wall = Wall()
    s, other_node = make_store(wall), make_store(wall)
    job_id = s.submit("m", "1", inputs(1), idempotency_key="order-42")
    assert other_node.submit("m", "1", inputs(1), idempotency_key="order-42") == job_id
    assert s.existing("m", "1", "order-42", inputs(1)) == job_id and s.queued_count() == 1
    assert s.existing("m", "1", "order-43", inputs(1)) is None
    assert s.submit("n", "1", inputs(1), idempotency_key="order-42") != job_id     # keys are per model
    with pytest.raises(IdempotencyConflict, match="Idempotency-Key: already used for job"):
        other_node.submit("m", "1", inputs(2), idempotency_key="order-42")
    s.claim_next(["m"])
    s.complete(job_id, inputs(3))
    wall.t += 59
    assert s.submit("m", "1", inputs(1), idempotency_key="order-42") == job_id    # the result still lives
    wall.t += 1
    assert s.existing("m", "1", "order-42", inputs(1)) is None
    fresh = s.submit("m", "1", inputs(2), idempotency_key="order-42")
    assert fresh != job_id and s.get(fresh).state == "queued"


def test_idempotency_keys_are_scoped_by_tenant(make_store: Make) -> None:
    """Tenant B reusing tenant A's key on a shared model gets a job of its own, never A's id nor a 422 naming it."""
    s, other_node = make_store(), make_store()
    a = s.submit("m", "1", inputs(1), tenant="acme", idempotency_key="order-1")
    b = other_node.submit("m", "1", inputs(1), tenant="globex", idempotency_key="order-1")
    assert b != a and s.get(b).tenant == "globex"
    assert s.existing("m", "1", "order-1", inputs(1), tenant="globex") == b
    assert s.existing("m", "1", "order-1", inputs(1), tenant="acme") == a
    assert s.existing("m", "1", "order-1", inputs(1)) is None            # keys off (no tenant): a scope of its own
    with pytest.raises(IdempotencyConflict) as conflict:
        s.submit("m", "1", inputs(2), tenant="globex", idempotency_key="order-1")
    assert a not in str(conflict.value) and b in str(conflict.value)
    assert s.submit("m", "1", inputs(1), tenant="acme", idempotency_key="order-1") == a
    assert s.queued_count() == 2


def test_a_job_keeps_its_tenant(make_store: Make) -> None:
    s = make_store()
    assert s.get(s.submit("m", "1", inputs(), tenant="acme")).tenant == "acme"
    assert s.get(s.submit("m", "1", inputs())).tenant is None


def test_fail_queued_stats_and_queued_models(make_store: Make) -> None:
    wall = Wall()
    jobs = make_store(wall)
    a1, a2, b = jobs.submit("a", "1", inputs()), jobs.submit("a", "2", inputs()), jobs.submit("b", "1", inputs())
    wall.t += 10
    later = jobs.submit("a", "1", inputs())
    assert jobs.queued_models() == {("a", "1"), ("a", "2"), ("b", "1")}
    assert jobs.queued_stats() == {("a", "1"): (2, 10.0), ("a", "2"): (1, 10.0), ("b", "1"): (1, 10.0)}
    assert jobs.claim_next(["a:1"]).id == a1
    assert jobs.fail_queued("a", "1", "gone") == 1
    assert jobs.get(later).state == "failed" and jobs.get(later).error == "gone"
    assert jobs.get(a1).state == "running" and jobs.get(a2).state == "queued"
    assert jobs.fail_queued("a", None, "gone") == 1 and jobs.get(a2).state == "failed"
    assert jobs.get(b).state == "queued"


def _damage(store: Any, backend: str, job_id: str) -> None:
    if backend == "sqlite":
        with sqlite3.connect(store.path) as db:
            db.execute("UPDATE jobs SET inputs = x'ffffffff00' WHERE id = ?", (job_id,))
    else:
        import psycopg

        with psycopg.connect(store.url) as db:
            db.execute("UPDATE ember_jobs SET inputs = '\\xffffffff00'::bytea WHERE id = %s", (job_id,))


def test_a_job_with_unreadable_inputs_fails_at_claim_and_the_next_one_is_claimed(make_store: Make,
                                                                                  backend: str) -> None:
    wall = Wall()
    s = make_store(wall)
    bad, good = s.submit("m", "1", inputs(1)), s.submit("m", "1", inputs(2))
    _damage(s, backend, bad)
    claimed = s.claim_next(["m:1"])
    assert claimed is not None and claimed.id == good
    failed = s.get(bad)
    assert failed.state == "failed" and failed.finished_at == wall.t
    assert failed.error is not None and "unreadable tensors" in failed.error
    assert s.claim_next() is None and s.requeue_running() == 1   # only the good job was running
