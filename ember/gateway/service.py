"""What the gateway needs from the serving core. The gateway knows nothing else of it."""

from __future__ import annotations

from typing import Any, Protocol

from ember.serving.results import (
    InferResult,
    InferStream,
    JobAccepted,
    JobStatus,
    ModelStatus,
    OnClaim,
    RepositoryEntry,
    WhenFull,
)
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors


class Service(Protocol):
    def contracts(self) -> list[ModelContract]:
        """The deployed models."""

    def contract(self, name: str, version: str | None = None) -> ModelContract:
        """One deployed model (latest version when None). Raises ModelNotFound."""

    def model_ready(self, name: str, version: str | None = None) -> bool: ...

    def server_ready(self) -> bool:
        """True once every deployed model can take a request on a local rung."""

    async def infer(
        self, contract: ModelContract, inputs: Tensors, *, respond_async: bool = False, when_full: WhenFull = "job",
        tenant: str | None = None,
        idempotency_key: str | None = None,
    ) -> InferResult | JobAccepted:
        """Run validated inputs down the ladder and collect every reply; a job it becomes is `tenant`'s. Raises
        EmberError subclasses (Overloaded when no instance had room and `when_full` is "reject"; JobStoreError
        when it had to become a job and the job store fails). A request that becomes a job under an
        `idempotency_key` that already names a live job of this model answers that job instead of queueing
        another."""

    async def stream(self, contract: ModelContract, inputs: Tensors, *, when_full: WhenFull = "reject",
                     tenant: str | None = None, on_claim: OnClaim | None = None) -> InferStream:
        """The request's replies as they come (returns with the first); `aclose()` withdraws it. Raises like
        `infer`. `tenant`: the caller's, which the model's instance is told (a model keeping state per tenant keeps
        it apart). `on_claim`: told the rung once the ladder decides it (the instance None while one starts), and
        the rung and instance once an instance holds the request, before its first reply (not for a stream served
        by another node: its rung comes with that reply)."""

    def job(self, job_id: str) -> JobStatus:
        """Raises JobNotFound."""

    def repository_index(self) -> list[RepositoryEntry]: ...

    async def load_model(self, name: str) -> None:
        """(Re)deploy a model known to the repository. Raises ModelNotFound, ModelNotReady."""

    async def unload_model(self, name: str) -> None: ...

    def status(self) -> list[ModelStatus]: ...

    async def node_status(self) -> dict[str, Any]:
        """The node beside its models: {"zygotes": [...], "jobs": [{"model", "version", "queued",
        "oldest_age_s"}], "job_store": "ok" | "failing" | the error}."""
