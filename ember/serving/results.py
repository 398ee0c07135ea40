"""What serving a request, a job or a status query produces: plain values the gateway renders.

They live beside the serving core, not in the gateway, so that serving/ and the job store
never import the gateway.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ember.core.states import Rung
from ember.errors import EmberError, ModelFailed, OutputMismatch
from ember.wire.tensors import Tensors

log = logging.getLogger("ember.gateway")

# Told the rung of a request as soon as the ladder decides it (the instance None while one starts for it), and the
# rung and instance once an instance holds it, before its first reply (a stream's headers).
OnClaim = Callable[[Rung, str | None], None]


def client_message(err: EmberError, where: str = "") -> str:
    """What a client is told of `err`. A model's own failure (ModelFailed: its code raised, and the message is
    that exception's text, which may hold paths, inputs or internals) is logged here with an incident id and
    answered without the text; every other error's message is ember's own and is answered as it is."""
    if not isinstance(err, ModelFailed) or isinstance(err, OutputMismatch):
        return err.message
    incident = uuid.uuid4().hex[:12]
    log.error("model failure %s%s: %s", incident, f" ({where})" if where else "", err.message)
    return f"the model failed on this request (incident {incident}; the server's log has the details)"


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


# What a request does when no instance has room: become a durable job (202), or wait longer and be refused
# (429 with Retry-After) for clients that cannot poll a job, such as OpenAI's.
WhenFull = Literal["job", "reject"]

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
    tenant: str | None = None         # who submitted it (None: authentication was off)


@dataclass(frozen=True)
class RepositoryEntry:
    name: str
    version: str
    state: Literal["READY", "UNAVAILABLE", "LOADING", "UNLOADING"]
    reason: str = ""
    # The contract's owner: None for a public model, "" when unknown (a contract that failed to load,
    # which only admins see: no tenant is named "").
    tenant: str | None = None


@dataclass(frozen=True)
class ModelStatus:
    """One model and its instances, for `ember status`."""

    name: str
    version: str
    state: str
    template: dict[str, Any] | None
    instances: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class InferStream:
    """A request's replies as they come (one, or several from a streaming model), and where it was served.

    Iterate it for the replies; `aclose()` withdraws the request (the instance stops its work). A stream
    that is iterated to its end needs no closing; one that is not must be closed, or its room stays taken.
    """

    rung: Rung
    instance_id: str
    replies: AsyncGenerator[Tensors, None]
    on_close: Callable[[], None] = lambda: None

    def __aiter__(self) -> AsyncGenerator[Tensors, None]:
        return self.replies

    async def aclose(self) -> None:
        await self.replies.aclose()
        self.on_close()   # also when the replies were never iterated (their generator never started)
