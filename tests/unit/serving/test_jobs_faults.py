"""The job runner when the job store fails: a full disk (SQLite max_page_count, so writes fail with
SQLITE_FULL) while a job finishes, a worker gone with its lease, idempotency keys through the controller."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import numpy as np
import pytest

from ember.errors import IdempotencyConflict, JobStoreError
from ember.jobs.store import JobStore
from ember.serving.results import InferResult, JobAccepted
from ember.testing.controller import World, X, settle, write
from ember.wire.tensors import Tensors

pytestmark = pytest.mark.anyio


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    write(tmp_path, "m")
    return tmp_path


def big_output(inputs: Tensors) -> Tensors:
    """A result of 80 KB: writing it needs new pages in the database."""
    return {"y": np.zeros(20_000, np.float32)}


def lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


async def test_a_result_written_while_the_disk_is_full_is_retried_and_sync_serving_goes_on(
        tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ember.controller")
    w = World(tmp, store_retry_s=0.01, store_retry_max_s=0.02)
    w.node.model, w.node.infer_delay = big_output, 0.1
    await w.ctl.deploy_all()
    accepted = await w.ctl.infer(w.ctl.contract("m"), X, respond_async=True)
    assert isinstance(accepted, JobAccepted)
    await asyncio.sleep(0.03)
    assert w.jobs.get(accepted.job_id).state == "running"
    w.jobs.set_max_bytes(w.jobs.path.stat().st_size)   # the disk fills up while the job runs
    await asyncio.sleep(0.3)                            # it has finished: its result write keeps failing
    assert w.jobs.get(accepted.job_id).state == "running"
    assert isinstance(await w.infer(), InferResult)     # synchronous requests never touch the store
    with pytest.raises(JobStoreError, match="disk is full") as refused:
        await w.ctl.infer(w.ctl.contract("m"), X, respond_async=True)
    assert refused.value.retry_after > 0 and str(tmp) not in refused.value.message
    await w.run_for(5)                                  # ticks while failing: no line each
    assert len(lines(caplog, "job store failing")) == 1 and not lines(caplog, "recovered")
    failing = lines(caplog, "job store failing")[0]
    assert str(w.jobs.path) in failing                  # the path is for the logs, not the clients
    w.jobs.set_max_bytes(None)                          # space again
    done = await settle(w, accepted.job_id, "succeeded", tick=True)
    assert done.state == "succeeded" and done.outputs is not None and done.outputs["y"].shape == (20_000,)
    await w.ctl.tick()
    assert len(lines(caplog, "job store recovered")) == 1
    again = await w.ctl.infer(w.ctl.contract("m"), X, respond_async=True)
    assert isinstance(again, JobAccepted)


async def test_a_job_whose_worker_is_gone_runs_again_once_its_lease_runs_out(
        tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ember.controller")
    w = World(tmp, request_timeout_s=5)   # the lease: 10 s
    await w.ctl.deploy_all()
    job_id = w.jobs.submit("m", "1", X)
    # Another gateway on the same file claimed it 60 s ago and was killed: no restart here will requeue it.
    with JobStore(w.jobs.path, max_queued=10, result_ttl_s=60, wall=lambda: time.time() - 60,
                  owner="killed-gateway") as killed:
        assert killed.claim_next() is not None
    recent = w.jobs.submit("m", "1", X)
    with JobStore(w.jobs.path, max_queued=10, result_ttl_s=60, owner="live-gateway") as live:
        assert live.claim_next(["m"]).id == recent  # type: ignore[union-attr]   # just claimed: its lease holds
    await w.run_for(3)
    assert (await settle(w, job_id, "succeeded", tick=True)).state == "succeeded"
    assert w.jobs.get(recent).state == "running"
    assert lines(caplog, "requeued 1 running job(s) whose worker's lease ran out")


async def test_an_idempotency_key_answers_the_same_job(tmp: Path) -> None:
    w = World(tmp)
    await w.ctl.deploy_all()
    first = await w.ctl.infer(w.ctl.contract("m"), X, respond_async=True, idempotency_key="k-1")
    assert isinstance(first, JobAccepted)
    done = await settle(w, first.job_id, "succeeded")
    assert done.state == "succeeded"
    # A repeat (its client lost the 202) gets the same job, done already, even with room to serve it now.
    for respond_async in (True, False):
        repeat = await w.ctl.infer(w.ctl.contract("m"), X, respond_async=respond_async, idempotency_key="k-1")
        assert isinstance(repeat, JobAccepted) and repeat.job_id == first.job_id
    with pytest.raises(IdempotencyConflict):
        await w.ctl.infer(w.ctl.contract("m"), {"x": X["x"] * 2}, respond_async=True, idempotency_key="k-1")
    assert isinstance(await w.ctl.infer(w.ctl.contract("m"), X, idempotency_key="k-2"), InferResult)
