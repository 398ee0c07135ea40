"""The durable job queue's side of serving: accept jobs, run them as soon as an instance has room, settle them.

The job store fsyncs each write (a few ms), so every call to it runs off the event loop. Jobs are
claimed whenever an instance may have room (`poke`, called as requests end and slices free), as many
at once as the placeable models have room for, in one transaction; the tick is only a safety net.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Protocol

from ember.errors import EmberError
from ember.serving.ports import ClaimedJobLike, JobQueue, LadderMetrics, NoCapacity
from ember.serving.results import JobAccepted
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

log = logging.getLogger("ember.controller")


class JobHost(Protocol):
    """What the job runner needs of the serving core."""

    async def serve(self, key: str, inputs: Tensors) -> Tensors:
        """Run one request now; NoCapacity when no instance has room."""

    def room(self) -> dict[str, int]:
        """Requests each model's instances could take now without waiting (models absent: none)."""

    def retry_after(self, key: str, ahead: int) -> float:
        """Seconds until a job with `ahead` jobs before it is likely done."""


class JobRunner:
    def __init__(self, jobs: JobQueue, metrics: LadderMetrics, host: JobHost,
                 spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self._jobs, self._metrics, self._host, self._spawn = jobs, metrics, host, spawn
        self._queued = 0          # a hint: jobs believed queued (the store is the truth)
        self._pending_run = False
        self._rerun = False
        self._published: set[str] = set()

    async def submit(self, contract: ModelContract, inputs: Tensors, tenant: str | None = None) -> JobAccepted:
        job_id = await asyncio.to_thread(self._jobs.submit, contract.name, contract.version, inputs, tenant)
        self._metrics.job(contract.key, "submitted")
        ahead = await asyncio.to_thread(self._jobs.queued_count, contract.name)
        self._queued += 1
        await self.publish()
        self.poke()
        return JobAccepted(job_id, self._host.retry_after(contract.key, max(0, ahead - 1)))

    def poke(self) -> None:
        """An instance may have room: run queued jobs (once at a time; a poke meanwhile runs it again)."""
        if self._queued <= 0:
            return
        if self._pending_run:
            self._rerun = True
            return
        self._pending_run = True
        self._spawn(self._run_until_settled())

    async def _run_until_settled(self) -> None:
        try:
            while True:
                self._rerun = False
                await self.run_pending()
                if not self._rerun:
                    return
        finally:
            self._pending_run = False

    async def run_pending(self) -> None:
        """Start every queued job whose model has room now, up to that room."""
        while True:
            room = {k: n for k, n in self._host.room().items() if n > 0}
            jobs = await asyncio.to_thread(self._jobs.claim, list(room), sum(room.values())) if room else []
            if not jobs:
                break
            self._queued = max(0, self._queued - len(jobs))
            for job in jobs:
                self._spawn(self._run(job))
            # Let the jobs' claims reach the pool before measuring room again.
            await asyncio.sleep(0)
        self._queued = await self.publish()

    async def publish(self) -> int:
        """Queue depth and the oldest job's age per model, to the metrics; the jobs queued in all."""
        stats = await asyncio.to_thread(self._jobs.queued_stats)
        for (name, version), (count, oldest_s) in stats.items():
            self._metrics.set_jobs(f"{name}:{version}", count, oldest_s)
        for key in self._published - {f"{n}:{v}" for n, v in stats}:
            self._metrics.set_jobs(key, 0, 0.0)   # drained since: say so rather than keep the last value
        self._published = {f"{n}:{v}" for n, v in stats}
        return sum(count for count, _ in stats.values())

    async def _run(self, job: ClaimedJobLike) -> None:
        key = f"{job.model}:{job.version}"
        try:
            outputs = await self._host.serve(key, job.inputs)
        except NoCapacity:
            await asyncio.to_thread(self._jobs.requeue, job.id)
            self._queued += 1
            return
        except EmberError as err:
            await asyncio.to_thread(self._jobs.fail, job.id, err.message)
            self._metrics.job(key, "failed")
            return
        except Exception as err:
            log.exception("job %s of %s failed", job.id, key)
            await asyncio.to_thread(self._jobs.fail, job.id, f"internal error: {type(err).__name__}")
            self._metrics.job(key, "failed")
            return
        await asyncio.to_thread(self._jobs.complete, job.id, outputs)
        self._metrics.job(key, "completed")

    async def refresh(self) -> None:
        """The tick's safety net: learn the queue's size from the store, and run what can run."""
        self._queued = await self.publish()
        self.poke()

    async def expire(self) -> None:
        await asyncio.to_thread(self._jobs.expire)

    async def recover(self, known: Iterable[tuple[str, str]], invalid: Iterable[str]) -> None:
        """At startup: jobs a previous server left running go back to the queue; jobs of models the
        repository no longer has would wait forever, so they fail. (A model listed with an invalid
        contract, `invalid`, keeps its jobs: fixing and loading it runs them.)"""
        requeued = await asyncio.to_thread(self._jobs.requeue_running)
        if requeued:
            log.info("requeued %d job(s) left running by a previous server", requeued)
        known, invalid = set(known), set(invalid)
        for model, version in await asyncio.to_thread(self._jobs.queued_models):
            if (model, version) not in known and model not in invalid:
                n = await asyncio.to_thread(self._jobs.fail_queued, model, version,
                                            f"model '{model}' version '{version}' is not in the repository")
                log.warning("failed %d queued job(s) of %s:%s, no longer in the repository", n, model, version)
        await self.refresh()

    async def fail_model(self, name: str) -> None:
        """An unloaded model's queued jobs fail (they would hold places in the bounded queue)."""
        failed = await asyncio.to_thread(self._jobs.fail_queued, name, None, f"model '{name}' was unloaded")
        if failed:
            log.warning("failed %d queued job(s) of unloaded model %s", failed, name)
