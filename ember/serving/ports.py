"""What the controller needs from the job store, the metrics, the tracer and the warm pool's forecast, declared
where it is used."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from types import TracebackType
from typing import Protocol

from ember.core.states import Rung
from ember.keepalive.forecast import IdleHistory
from ember.serving.results import JobStatus
from ember.wire.tensors import Tensors


class ClaimedJobLike(Protocol):
    id: str
    model: str
    version: str
    inputs: Tensors
    tenant: str | None


class JobQueue(Protocol):
    def submit(self, model: str, version: str, inputs: Tensors, tenant: str | None = None,
               idempotency_key: str | None = None) -> str: ...
    def existing(self, model: str, version: str, idempotency_key: str, inputs: Tensors,
                 tenant: str | None = None) -> str | None: ...
    def claim(self, models: Collection[str] | None = None, limit: int = 1) -> Sequence[ClaimedJobLike]: ...
    def complete(self, job_id: str, outputs: Tensors) -> None: ...
    def fail(self, job_id: str, message: str) -> None: ...
    def requeue(self, job_id: str) -> None: ...
    def renew(self, job_ids: Collection[str]) -> int: ...
    def reclaim_expired(self, lease_s: float) -> int: ...
    def get(self, job_id: str) -> JobStatus: ...
    def requeue_running(self) -> int: ...
    def fail_queued(self, model: str, version: str | None, message: str) -> int: ...
    def queued_models(self) -> set[tuple[str, str]]: ...
    def expire(self) -> int: ...
    def queued_count(self, model: str | None = None) -> int: ...
    def queued_stats(self) -> dict[tuple[str, str], tuple[int, float]]: ...


class LadderMetrics(Protocol):
    """Models are named by their `name:version` key (the metrics split it into labels)."""

    def observe_ladder(self, model: str, rung: Rung, time_to_ready_s: float | None,
                       time_to_first_response_s: float) -> None: ...
    def first_response(self, model: str, rung: Rung, seconds: float) -> None: ...
    def cold_start(self, model: str, rung: Rung, phases: Mapping[str, float]) -> None: ...
    def instance_event(self, model: str, event: str) -> None: ...
    def worker_crash(self, model: str) -> None: ...
    def set_instances(self, model: str, state: str, n: int) -> None: ...
    def set_load(self, model: str, in_flight: int, waiting: int, desired: int, panic: bool) -> None: ...
    def set_memory(self, model: str, pss_bytes: int) -> None: ...
    def set_store(self, tier_bytes: Mapping[str, int], fetched_bytes: Mapping[str, int], fetch_s: float) -> None: ...
    def set_jobs(self, model: str, queued: int, oldest_age_s: float) -> None: ...
    def job(self, model: str, outcome: str) -> None: ...


class Histories(Protocol):
    """Who makes a model's idle history (the keep-alive policy's, or the warm pool's forecast's)."""

    def new_history(self) -> IdleHistory: ...


class IdleForecast(Histories, Protocol):
    """The warm pool's forecast (`ember.keepalive.arrivals.LadderForecast`): the chance of a request within
    `period_s`, given a model's idle history and how long it has been idle."""

    def chance(self, history: IdleHistory | None, idle_s: float, period_s: float) -> float: ...


class NoCapacity(Exception):
    """No instance can take the request now (it becomes, or stays, a queued job). Never leaves serving/."""


Attribute = str | int | float | bool


class Span(Protocol):
    """One timed step of a request (a trace span). Used as a `with` block, it ends with the block and records
    an exception that leaves it; a span that outlives a block (a request's inference) is ended by `end()`."""

    def set(self, key: str, value: Attribute) -> None: ...
    def phases(self, seconds: Mapping[str, float]) -> None:
        """Steps done elsewhere that ended just now (an instance's start: spawn, fetch, load, warmup)."""
    def fail(self, message: str) -> None: ...
    def end(self) -> None:
        """Idempotent: a span ends once."""
    def __enter__(self) -> Span: ...
    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None: ...


class Tracer(Protocol):
    def start(self, name: str) -> Span:
        """A span under the current request's span (none is recorded outside a request)."""


class _NoSpan:
    """What a span is with tracing off: nothing, at the cost of a method call."""

    def set(self, key: str, value: Attribute) -> None:
        pass

    def phases(self, seconds: Mapping[str, float]) -> None:
        pass

    def fail(self, message: str) -> None:
        pass

    def end(self) -> None:
        pass

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        pass


NO_SPAN: Span = _NoSpan()


class NoTracer:
    """Tracing off (the default; `ember serve --otel` turns it on)."""

    def start(self, name: str) -> Span:
        return NO_SPAN
