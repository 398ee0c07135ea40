"""The durable job queue's side of serving: accept jobs, run them as soon as an instance has room, settle them.

The job store fsyncs each write (a few ms), so every call to it runs off the event loop. Jobs are
claimed whenever an instance may have room (`poke`, called as requests end and slices free), as many
at once as the placeable models have room for, in one transaction; the tick is only a safety net.

The job store may fail at run time (disk full, a damaged file, locked): synchronous requests never
touch it, so they go on serving. While it fails, submissions answer JobStoreError (503 with
Retry-After) instead of queueing work that may never run, pokes stop, the tick keeps retrying, and one
log line marks each change of state (failing, recovered), not each try. A job whose result cannot be
written keeps its outputs here and retries the write with backoff (its lease renewed meanwhile), so it
does not stay "running" until a restart. The tick also renews the leases of the jobs running here and
puts back in the queue those whose lease ran out (their worker is gone): delivery is at least once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Protocol

from ember.core.clock import Clock
from ember.errors import EmberError, JobNotFound, JobStoreError
from ember.serving.ports import ClaimedJobLike, JobQueue, LadderMetrics, NoCapacity
from ember.serving.results import JobAccepted, client_message
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

log = logging.getLogger("ember.controller")


class JobHost(Protocol):
    """What the job runner needs of the serving core."""

    async def serve(self, key: str, inputs: Tensors, tenant: str | None = None) -> Tensors:
        """Run one request now, for `tenant` (the job's; None: none); NoCapacity when no instance has room."""

    def room(self) -> dict[str, int]:
        """Requests each model's instances could take now without waiting (models absent: none)."""

    def retry_after(self, key: str, ahead: int) -> float:
        """Seconds until a job with `ahead` jobs before it is likely done."""


class JobRunner:
    def __init__(self, jobs: JobQueue, metrics: LadderMetrics, host: JobHost,
                 spawn: Callable[[Coroutine[Any, Any, None]], None], clock: Clock, *, lease_s: float = 120.0,
                 retry_first_s: float = 0.1, retry_max_s: float = 5.0, shared: bool = False) -> None:
        self._jobs, self._metrics, self._host, self._spawn, self._clock = jobs, metrics, host, spawn, clock
        self._shared = shared     # other nodes use the store too: never fail the jobs of models this one lacks
        self._lease_s, self._retry_first_s, self._retry_max_s = lease_s, retry_first_s, retry_max_s
        self._queued = 0          # a hint: jobs believed queued (the store is the truth)
        self._pending_run = False
        self._rerun = False
        self._published: set[str] = set()
        self.queued_by_model: dict[str, int] = {}   # as the store last said, "name:version" -> jobs
        self._inflight: set[str] = set()   # jobs claimed here and not yet settled in the store
        self._settling = 0                 # results waiting to be written
        self._leases_at = float("-inf")    # when leases were last renewed and reclaimed
        self._down: JobStoreError | None = None
        self._draining = False             # shutting down: no new claims, running jobs finish

    # ----- health: one line per change of state -------------------------------------------

    def _failed(self, err: JobStoreError) -> None:
        if self._down is None:
            log.error("job store failing: %s [%s]. Job submissions answer 503 with Retry-After, synchronous "
                      "requests still serve; retrying.", err.message, err.where)
        else:
            log.debug("job store still failing: %s", err.message)
        self._down = err

    def _recovered(self) -> None:
        if self._down is not None:
            log.warning("job store recovered: accepting and running jobs again")
        self._down = None

    @property
    def healthy(self) -> bool:
        return self._down is None

    # ----- submissions -----------------------------------------------------------------------

    async def submit(self, contract: ModelContract, inputs: Tensors, tenant: str | None = None,
                     idempotency_key: str | None = None) -> JobAccepted:
        if self._down is not None:
            raise JobStoreError(f"job store unavailable: {self._down.message}", self._down.retry_after)
        try:
            job_id = await asyncio.to_thread(self._jobs.submit, contract.name, contract.version, inputs, tenant,
                                             idempotency_key)
            ahead = await asyncio.to_thread(self._jobs.queued_count, contract.name)
        except JobStoreError as err:
            self._failed(err)
            raise
        self._metrics.job(contract.key, "submitted")
        self._queued += 1
        await self.publish()
        self.poke()
        return JobAccepted(job_id, self._host.retry_after(contract.key, max(0, ahead - 1)))

    async def existing(self, contract: ModelContract, inputs: Tensors, idempotency_key: str,
                       tenant: str | None = None) -> JobAccepted | None:
        """The job an earlier submission with this key made, if it lives (IdempotencyConflict: other inputs).
        A failing store answers None: the request goes on, and fails only if it must become a job."""
        try:
            job_id = await asyncio.to_thread(self._jobs.existing, contract.name, contract.version,
                                             idempotency_key, inputs, tenant)
        except JobStoreError as err:
            self._failed(err)
            return None
        return None if job_id is None else JobAccepted(job_id, self._host.retry_after(contract.key, 0))

    # ----- running ---------------------------------------------------------------------------

    def poke(self) -> None:
        """An instance may have room: run queued jobs (once at a time; a poke meanwhile runs it again).
        While the store fails, only the tick tries it."""
        if self._queued <= 0 or self._down is not None or self._draining:
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
        try:
            await self._claim_and_start()
        except JobStoreError as err:
            self._failed(err)

    async def _claim_and_start(self) -> None:
        while not self._draining:
            room = {k: n for k, n in self._host.room().items() if n > 0}
            jobs = await asyncio.to_thread(self._jobs.claim, list(room), sum(room.values())) if room else []
            if not jobs:
                break
            self._queued = max(0, self._queued - len(jobs))
            for job in jobs:
                self._inflight.add(job.id)
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
        self.queued_by_model = {f"{n}:{v}": count for (n, v), (count, _) in stats.items()}
        return sum(count for count, _ in stats.values())

    async def _run(self, job: ClaimedJobLike) -> None:
        key = f"{job.model}:{job.version}"
        try:
            await self._serve(job, key)
        finally:
            self._inflight.discard(job.id)

    async def _serve(self, job: ClaimedJobLike, key: str) -> None:
        try:
            outputs = await self._host.serve(key, job.inputs, job.tenant)
        except NoCapacity:
            if await self._settle(job.id, key, self._jobs.requeue):
                self._queued += 1
            return
        except EmberError as err:
            if await self._settle(job.id, key, self._jobs.fail, client_message(err, f"job {job.id} of {key}")):
                self._metrics.job(key, "failed")
            return
        except Exception as err:
            log.exception("job %s of %s failed", job.id, key)
            if await self._settle(job.id, key, self._jobs.fail, f"internal error: {type(err).__name__}"):
                self._metrics.job(key, "failed")
            return
        if await self._settle(job.id, key, self._jobs.complete, outputs):
            self._metrics.job(key, "completed")

    async def _settle(self, job_id: str, key: str, write: Callable[..., None], *args: Any) -> bool:
        """Write a job's end to the store, retrying with backoff while the store fails. False: the job was
        no longer ours to settle (its lease ran out and it went back to the queue; it runs again)."""
        delay = self._retry_first_s
        self._settling += 1
        try:
            while True:
                try:
                    await asyncio.to_thread(write, job_id, *args)
                    return True
                except JobNotFound:
                    log.warning("job %s of %s: its lease ran out before its result was written; it runs again",
                                job_id, key)
                    return False
                except JobStoreError as err:
                    self._failed(err)
                await asyncio.sleep(delay)
                delay = min(2 * delay, self._retry_max_s)
        finally:
            self._settling -= 1

    # ----- shutdown ------------------------------------------------------------------------

    def stop_claiming(self) -> None:
        """Shutting down: claim no more jobs (queued ones stay queued, durable); running ones go on. Safe to call
        from a signal handler (it only sets a flag)."""
        self._draining = True

    @property
    def running(self) -> list[str]:
        """Jobs claimed here and not yet settled in the store."""
        return sorted(self._inflight)

    async def drain(self, timeout_s: float, step_s: float = 0.02) -> list[str]:
        """Claim no more and wait up to `timeout_s` for the running jobs to finish and their results to be
        written (the tick goes on meanwhile: leases are renewed). Returns the jobs still running then."""
        self.stop_claiming()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout_s)
        while self._inflight and loop.time() < deadline:
            await asyncio.sleep(min(step_s, max(0.0, deadline - loop.time())))
        return self.running

    async def give_back(self, job_ids: Iterable[str]) -> int:
        """Jobs cut off by a shutdown (their tasks cancelled) back to the queue, in their place, at once: the
        next server (or another node) runs them without waiting for a restart or a lease. Returns how many."""
        back = 0
        for job_id in job_ids:
            try:
                await asyncio.to_thread(self._jobs.requeue, job_id)
                back += 1
            except JobNotFound:
                pass   # its result was written after all
            except JobStoreError as err:
                log.error("job %s: could not put it back in the queue (%s); a restart or its lease does",
                          job_id, err.message)
        return back

    # ----- the tick ------------------------------------------------------------------------

    async def refresh(self) -> None:
        """The tick's safety net: renew and reclaim leases, learn the queue's size from the store, run what
        can run. While the store fails this is its retry; it recovers once all of it (and every result
        waiting to be written) went through."""
        try:
            await self._leases()
            self._queued = await self.publish()
            if self._down is not None and self._queued > 0:
                await self._claim_and_start()   # pokes are off while down: the claim is tried here
        except JobStoreError as err:
            self._failed(err)
            return
        if self._settling == 0:
            self._recovered()
        self.poke()

    async def _leases(self) -> None:
        now = self._clock.now()
        if now - self._leases_at < self._lease_s / 4:
            return
        if self._inflight:
            await asyncio.to_thread(self._jobs.renew, set(self._inflight))
        reclaimed = await asyncio.to_thread(self._jobs.reclaim_expired, self._lease_s)
        if reclaimed:
            log.warning("requeued %d running job(s) whose worker's lease ran out (%.0f s): they run again",
                        reclaimed, self._lease_s)
        self._leases_at = now

    async def expire(self) -> None:
        try:
            await asyncio.to_thread(self._jobs.expire)
        except JobStoreError as err:
            self._failed(err)

    async def recover(self, known: Iterable[tuple[str, str]], invalid: Iterable[str]) -> None:
        """At startup: jobs a previous server left running go back to the queue; jobs of models the
        repository no longer has would wait forever, so they fail. (A model listed with an invalid
        contract, `invalid`, keeps its jobs: fixing and loading it runs them.) A failing store is left
        to the tick: leases bring back what was left running."""
        try:
            await self._recover(set(known), set(invalid))
        except JobStoreError as err:
            self._failed(err)
        await self.refresh()

    async def _recover(self, known: set[tuple[str, str]], invalid: set[str]) -> None:
        requeued = await asyncio.to_thread(self._jobs.requeue_running)
        if requeued:
            log.info("requeued %d job(s) left running by a previous server", requeued)
        if self._shared:
            return
        for model, version in await asyncio.to_thread(self._jobs.queued_models):
            if (model, version) not in known and model not in invalid:
                n = await asyncio.to_thread(self._jobs.fail_queued, model, version,
                                            f"model '{model}' version '{version}' is not in the repository")
                log.warning("failed %d queued job(s) of %s:%s, no longer in the repository", n, model, version)

    async def fail_model(self, name: str) -> None:
        """An unloaded model's queued jobs fail (they would hold places in the bounded queue); with a shared
        store they stay, for the other nodes."""
        if self._shared:
            return
        try:
            failed = await asyncio.to_thread(self._jobs.fail_queued, name, None, f"model '{name}' was unloaded")
        except JobStoreError as err:
            self._failed(err)
            return
        if failed:
            log.warning("failed %d queued job(s) of unloaded model %s", failed, name)
