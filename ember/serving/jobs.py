"""The durable job queue's side of serving: accept jobs, run those that can be placed, settle them.

The job store fsyncs each write (a few ms), so every call to it runs off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

from ember.errors import EmberError
from ember.serving.ports import ClaimedJobLike, JobQueue, LadderMetrics, NoCapacity
from ember.serving.results import InferResult, JobAccepted
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

log = logging.getLogger("ember.controller")

Serve = Callable[[str, Tensors], Awaitable[InferResult]]


class JobRunner:
    def __init__(self, jobs: JobQueue, metrics: LadderMetrics, serve: Serve, placeable: Callable[[], list[str]],
                 spawn: Callable[[Coroutine[Any, Any, None]], None], retry_after_s: float) -> None:
        self._jobs, self._metrics, self._serve = jobs, metrics, serve
        self._placeable, self._spawn, self._retry_after_s = placeable, spawn, retry_after_s

    async def submit(self, contract: ModelContract, inputs: Tensors) -> JobAccepted:
        job_id = await asyncio.to_thread(self._jobs.submit, contract.name, contract.version, inputs)
        self._metrics.set_jobs_queued(await asyncio.to_thread(self._jobs.queued_count))
        self._spawn(self.run_pending())
        return JobAccepted(job_id, self._retry_after_s)

    async def run_pending(self) -> None:
        """Start every queued job whose model can be placed now without waiting."""
        while True:
            keys = self._placeable()
            job = await asyncio.to_thread(self._jobs.claim_next, keys) if keys else None
            if job is None:
                break
            self._spawn(self._run(job))
            # Let the job's claim reach the pool before placing the next one.
            await asyncio.sleep(0)
        self._metrics.set_jobs_queued(await asyncio.to_thread(self._jobs.queued_count))

    async def _run(self, job: ClaimedJobLike) -> None:
        key = f"{job.model}:{job.version}"
        try:
            result = await self._serve(key, job.inputs)
        except NoCapacity:
            await asyncio.to_thread(self._jobs.requeue, job.id)
            return
        except EmberError as err:
            await asyncio.to_thread(self._jobs.fail, job.id, err.message)
            return
        except Exception as err:
            log.exception("job %s of %s failed", job.id, key)
            await asyncio.to_thread(self._jobs.fail, job.id, f"internal error: {type(err).__name__}")
            return
        await asyncio.to_thread(self._jobs.complete, job.id, result.outputs)

    async def has_queued(self) -> bool:
        return bool(await asyncio.to_thread(self._jobs.queued_count))

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

    async def fail_model(self, name: str) -> None:
        """An unloaded model's queued jobs fail (they would hold places in the bounded queue)."""
        failed = await asyncio.to_thread(self._jobs.fail_queued, name, None, f"model '{name}' was unloaded")
        if failed:
            log.warning("failed %d queued job(s) of unloaded model %s", failed, name)
