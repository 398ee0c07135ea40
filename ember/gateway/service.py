"""What the gateway needs from the serving core. The gateway knows nothing else of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ember.core.states import Rung
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors


@dataclass(frozen=True)
class InferResult:
    outputs: Tensors
    rung: Rung            # the rung the serving instance came from for this request
    instance_id: str


@dataclass(frozen=True)
class JobAccepted:
    """No capacity now (or the client asked for async): a durable job was queued."""

    job_id: str
    retry_after: float


JobState = Literal["queued", "running", "succeeded", "failed"]


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    model: str
    version: str
    state: JobState
    created_at: float                 # unix seconds
    finished_at: float | None = None
    outputs: Tensors | None = None    # when succeeded
    error: str | None = None          # when failed


@dataclass(frozen=True)
class RepositoryEntry:
    name: str
    version: str
    state: Literal["READY", "UNAVAILABLE", "LOADING", "UNLOADING"]
    reason: str = ""


@dataclass(frozen=True)
class ModelStatus:
    """One model and its instances, for `ember status`."""

    name: str
    version: str
    state: str
    template: dict[str, Any] | None
    instances: list[dict[str, Any]] = field(default_factory=list)


class Service(Protocol):
    def contracts(self) -> list[ModelContract]:
        """The deployed models."""

    def contract(self, name: str, version: str | None = None) -> ModelContract:
        """One deployed model (latest version when None). Raises ModelNotFound."""

    def model_ready(self, name: str, version: str | None = None) -> bool: ...

    def server_ready(self) -> bool:
        """True once every deployed model can take a request on a local rung."""

    async def infer(
        self, contract: ModelContract, inputs: Tensors, *, respond_async: bool = False
    ) -> InferResult | JobAccepted:
        """Run validated inputs down the ladder. Raises EmberError subclasses."""

    def job(self, job_id: str) -> JobStatus:
        """Raises JobNotFound."""

    def repository_index(self) -> list[RepositoryEntry]: ...

    async def load_model(self, name: str) -> None:
        """(Re)deploy a model known to the repository. Raises ModelNotFound, ModelNotReady."""

    async def unload_model(self, name: str) -> None: ...

    def status(self) -> list[ModelStatus]: ...
