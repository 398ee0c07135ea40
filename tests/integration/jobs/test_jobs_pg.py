"""What only the shared (PostgreSQL) job store does: claims that skip rows another node is claiming, restarts
that requeue only their own node's jobs, nodes creating the table at once, and a database that is away."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import psycopg
import pytest

from ember.errors import JobStoreError
from ember.jobs.postgres import PgJobStore, redacted
from ember.ports import free_port

from .conftest import Wall


def inputs(i: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.full(4, i, dtype=np.float32)}


def store(url: str, wall: Wall | None = None, **kw: object) -> PgJobStore:
    return PgJobStore(url, max_queued=100, result_ttl_s=60.0, wall=wall or Wall(), **kw)  # type: ignore[arg-type]


def test_a_claim_skips_the_rows_another_node_is_claiming_without_waiting(pg_url: str) -> None:
    with store(pg_url) as s:
        first, second = s.submit("m", "1", inputs(1)), s.submit("m", "1", inputs(2))
        with psycopg.connect(pg_url) as other, other.transaction():   # another node, mid-claim of `first`
            other.execute("SELECT id FROM ember_jobs WHERE id = %s FOR UPDATE", (first,))
            claimed = s.claim(None, 2)
            assert [j.id for j in claimed] == [second]
        assert s.claim_next().id == first  # type: ignore[union-attr]   # released: claimable again


def test_a_restart_requeues_its_own_nodes_jobs_only(pg_url: str) -> None:
    with store(pg_url, node="a") as a, store(pg_url, node="b") as b:
        mine, theirs = a.submit("m", "1", inputs(1)), a.submit("m", "1", inputs(2))
        assert a.claim_next().id == mine and b.claim_next().id == theirs  # type: ignore[union-attr]
    with store(pg_url, node="a") as restarted:
        assert restarted.requeue_running() == 1
        assert restarted.get(mine).state == "queued" and restarted.get(theirs).state == "running"


def test_nodes_starting_at_once_on_an_empty_database_all_work(pg_url: str) -> None:
    stores: list[PgJobStore] = []
    start = threading.Barrier(4)

    def open_one() -> None:
        start.wait()
        stores.append(store(pg_url))   # each creates the table if absent, one at a time

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [s.submit("m", "1", inputs(i)) for i, s in enumerate(stores)]
    assert stores[0].queued_count() == 4 and len(set(ids)) == 4
    for s in stores:
        s.close()


def test_an_unreachable_database_is_a_job_store_error_naming_no_host_or_password(tmp_path: Path) -> None:
    url = f"postgresql://ember:s3cret@127.0.0.1:{free_port()}/jobs"
    s = PgJobStore(url, max_queued=10, result_ttl_s=60.0, connect_timeout_s=2)   # never raises: sync serving goes on
    with pytest.raises(JobStoreError, match="job store: connect failed: cannot reach the database server") as err:
        s.submit("m", "1", inputs())
    assert "s3cret" not in err.value.message and "127.0.0.1" not in err.value.message
    assert err.value.where == redacted(url) == f"postgresql://ember@127.0.0.1:{url.split(':')[3].split('/')[0]}/jobs"
    assert err.value.retry_after > 0
    s.close()
    with pytest.raises(JobStoreError, match="closed"):
        s.queued_count()


def test_a_lost_connection_fails_one_call_and_the_next_reconnects(pg_url: str) -> None:
    with store(pg_url) as s:
        job_id = s.submit("m", "1", inputs())
        with psycopg.connect(pg_url, autocommit=True) as admin:   # the server drops the store's connection
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'ember'")
        with pytest.raises(JobStoreError, match="job store: get failed"):
            s.get(job_id)
        assert s.get(job_id).state == "queued"
