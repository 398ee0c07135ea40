"""The one error tree of ember.

Every error that can reach a client is an `EmberError`. Adapters translate foreign
exceptions (OSError, sqlite3.Error, pydantic.ValidationError, ...) into one of these
where they meet them; only the gateway maps them to HTTP status codes.

    EmberError
    ├── InvalidInput          bad request body, tensor, field or contract   (400)
    │   ├── ContractInvalid   a model contract that fails validation        (400)
    │   ├── IdempotencyConflict  an Idempotency-Key reused for another request (422)
    │   └── ModelTooLarge     no node of the cluster could ever hold the model (at deploy)
    ├── Unauthenticated       no API key, or one that is unknown or revoked (401)
    ├── Forbidden             a role that may not, or a cross-site request  (403)
    ├── ModelNotFound         no such model or version (or not the caller's) (404)
    ├── JobNotFound           no such job (or its result expired, or another tenant's) (404)
    ├── ChunkNotFound         a peer asked this node for a weight chunk it does not hold (404)
    ├── PayloadTooLarge       request body over the configured limit        (413)
    ├── UnsupportedMediaType  a Content-Type a JSON route does not take      (415)
    ├── RequestTimeout        the body stalled: no byte within body_timeout_s (408)
    ├── Overloaded            queue full; carries retry_after seconds       (429)
    │   └── RateLimited       the tenant's request rate is over its limit   (429)
    ├── ModelNotReady         known model that cannot take requests now     (503)
    ├── JobStoreError         the job store cannot take or hand out jobs now (503 + Retry-After;
    │                         disk full, damaged file, locked; the message never names a path)
    ├── StoreError            weight store failures                         (503)
    │   ├── ChunkCorrupt      a chunk failed its hash check on every tier
    │   └── TierUnavailable   a tier (e.g. the remote origin) is unreachable
    ├── DeadlineExceeded      the request's deadline passed                 (504)
    ├── Cancelled             the client went away; its work was stopped    (499, logged only)
    ├── WorkerCrashed         the instance serving the request died         (502)
    │   └── NodeUnreachable   a peer node's gateway took a forwarded request and was lost before it
    │       │                 answered (not run again elsewhere unless the contract is idempotent)
    │       └── NotDelivered  its gateway never took it: not reached, or reset with the request unread
    │                         (retried once on another node; docs/cluster.md)
    └── ModelFailed           the model's own code raised on a request      (500)
        └── OutputMismatch    its reply is not what its contract declares   (500; at warm-up the model
                              becomes UNAVAILABLE instead: ContractInvalid)
"""

from __future__ import annotations


class EmberError(Exception):
    """Base of every error ember raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidInput(EmberError):
    """The request (or a field of it) is malformed; the message names the field."""


class ContractInvalid(InvalidInput):
    """A model contract failed validation; the message names the key."""


class Unauthenticated(EmberError):
    """The request carries no API key, or one that is unknown or revoked."""


class Forbidden(EmberError):
    """The caller is known but may not do this (its role), or the request came from another site."""


class UnsupportedMediaType(EmberError):
    """The body's Content-Type is not one the route takes."""


class IdempotencyConflict(InvalidInput):
    """An Idempotency-Key already names a job of that model whose inputs differ (IETF draft: 422)."""


class ModelTooLarge(InvalidInput):
    """No node could hold one instance of the model, even empty (memory, or a slice of its kind): a deploy-time
    error naming the model and the largest node, never an out-of-memory at run time."""


class ModelNotFound(EmberError):
    """No model (or version) by that name is deployed (or the caller's tenant may not see it)."""

    @classmethod
    def absent(cls, name: str, version: str | None = None) -> ModelNotFound:
        """The one message for a model that is not there, so that a model hidden from a tenant reads the same."""
        what = f"model '{name}'" + (f" version '{version}'" if version else "")
        return cls(f"{what} is not deployed")


class JobNotFound(EmberError):
    """No job by that id (never submitted, or its result expired, or another tenant's)."""

    @classmethod
    def unknown(cls, job_id: str) -> JobNotFound:
        """The one message for a job that is not there, so that another tenant's job reads the same."""
        return cls(f"job {job_id}: no such job (never submitted, or its result expired)")


class ChunkNotFound(EmberError):
    """A peer asked for a weight-store chunk this node does not hold (it fetches it elsewhere)."""


class PayloadTooLarge(EmberError):
    """The request body exceeds the configured maximum size."""


class RequestTimeout(EmberError):
    """The client stopped sending its request body (no progress within the body timeout)."""


class Overloaded(EmberError):
    """ember cannot accept more work now; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RateLimited(Overloaded):
    """The caller's tenant sent more requests than its rate limit allows; retry after `retry_after` seconds."""


class ModelNotReady(EmberError):
    """The model is known but cannot take a request (unloaded, failed to start)."""


class JobStoreError(EmberError):
    """The job database failed (disk full, damaged file, locked too long, ...); retry after `retry_after`.

    `message` reaches clients and names no file; `where` (the database's path) is for the logs only."""

    def __init__(self, message: str, retry_after: float = 5.0, where: str = "") -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.where = where


class StoreError(EmberError):
    """The weight store could not produce a model's bytes."""


class ChunkCorrupt(StoreError):
    """A chunk failed its hash check and no tier holds a good copy."""


class TierUnavailable(StoreError):
    """A store tier (for example the remote origin) cannot be reached."""


class DeadlineExceeded(EmberError):
    """The request's deadline passed before it was answered."""


class Cancelled(EmberError):
    """The request was withdrawn (its client disconnected); the instance stopped its work."""


class WorkerCrashed(EmberError):
    """The instance serving the request died before answering."""


class NodeUnreachable(WorkerCrashed):
    """A peer node's gateway could not be reached, or dropped a forwarded request mid-way: the node may be gone.
    `answered`: the node's machine answered (it refused, reset or closed the connection), so the other requests
    waiting on it will each get an answer of their own; else it fell silent (a timeout) and they never will."""

    def __init__(self, message: str, answered: bool = False) -> None:
        super().__init__(message)
        self.answered = answered


class NotDelivered(NodeUnreachable):
    """A peer node's gateway never took the forwarded request (no connection: refused, timed out, no route; or
    its kernel reset the connection before any reply, the request unread: docs/cluster.md), so it may be sent
    to another."""


class ModelFailed(EmberError):
    """The model's own code raised while handling a request (the instance lives on)."""


class OutputMismatch(ModelFailed):
    """The model's reply does not match its contract's outputs (names, datatypes, shapes)."""


def error_fields(err: EmberError) -> dict[str, str | float | None]:
    """What crosses a process or node boundary of an error: its class's name, its message and, for the errors
    that carry one, `retry_after`. `error_named` makes it an error again on the other side."""
    return {"kind": type(err).__name__, "message": err.message, "retry_after": getattr(err, "retry_after", None)}


def error_named(kind: object, message: str, retry_after: object = None) -> EmberError | None:
    """The error `kind` names (a class of this tree; not the base), rebuilt with its message and, where the class
    has one, `retry_after`; None when `kind` names none or its class needs more than a message (the caller says
    what the error becomes then)."""
    cls = globals().get(str(kind))
    if not (isinstance(cls, type) and issubclass(cls, EmberError)) or cls is EmberError:
        return None
    if issubclass(cls, Overloaded | JobStoreError) and isinstance(retry_after, int | float):
        return cls(message, retry_after)
    try:
        return cls(message)
    except TypeError:
        return None
