"""The one table from ember's error classes to HTTP status codes, and the error bodies.

V2 routes answer `{"error": "..."}` (what tritonclient reads); OpenAI routes answer
`{"error": {"message", "type", "param", "code"}}` (what the openai client reads). An
unexpected exception is logged with its traceback and answered `internal error`; its
text never reaches the client.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse

from ember.errors import (
    Cancelled,
    ChunkNotFound,
    DeadlineExceeded,
    EmberError,
    Forbidden,
    IdempotencyConflict,
    InvalidInput,
    JobNotFound,
    JobStoreError,
    ModelFailed,
    ModelNotFound,
    ModelNotReady,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    StoreError,
    Unauthenticated,
    UnsupportedMediaType,
    WorkerCrashed,
)
from ember.serving.results import client_message

log = logging.getLogger("ember.gateway")
M = TypeVar("M", bound=BaseModel)

# Looked up along the exception's MRO, so subclasses (ContractInvalid, ChunkCorrupt, ...) inherit.
STATUS_OF: dict[type[EmberError], int] = {
    InvalidInput: 400,
    Unauthenticated: 401,
    Forbidden: 403,
    IdempotencyConflict: 422,
    ModelNotFound: 404,
    JobNotFound: 404,
    ChunkNotFound: 404,
    PayloadTooLarge: 413,
    UnsupportedMediaType: 415,
    RequestTimeout: 408,
    Overloaded: 429,
    ModelFailed: 500,
    WorkerCrashed: 502,
    ModelNotReady: 503,
    StoreError: 503,
    JobStoreError: 503,
    DeadlineExceeded: 504,
    Cancelled: 499,   # nginx's "client closed request": nobody reads it, but access logs and metrics do
}

# OpenAI's `type` for each status; `code` adds a finer reason where OpenAI has one.
_OPENAI_TYPE = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
                404: "invalid_request_error", 408: "timeout", 413: "invalid_request_error",
                415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_exceeded",
                499: "client_closed_request", 500: "server_error", 502: "server_error", 503: "server_error",
                504: "server_error"}
_OPENAI_CODE: dict[type[EmberError], str] = {ModelNotFound: "model_not_found", JobNotFound: "job_not_found",
                                             PayloadTooLarge: "payload_too_large", Unauthenticated: "invalid_api_key",
                                             IdempotencyConflict: "idempotency_key_reused"}


class ParamError(InvalidInput):
    """An InvalidInput about one named request field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def status_of(err: EmberError) -> int:
    for cls in type(err).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return 500


def retry_after_header(seconds: float) -> dict[str, str]:
    """Retry-After is whole seconds (RFC 9110); never 0, which would invite a hot loop."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def _headers(err: EmberError) -> dict[str, str]:
    if isinstance(err, Unauthenticated):
        return {"WWW-Authenticate": 'Bearer realm="ember"'}
    if isinstance(err, RequestTimeout):   # the rest of its body may never come: the connection cannot be reused
        return {"Connection": "close"}
    return retry_after_header(err.retry_after) if isinstance(err, Overloaded | JobStoreError) else {}


def v2_error(err: EmberError) -> JSONResponse:
    return JSONResponse({"error": client_message(err)}, status_code=status_of(err), headers=_headers(err))


def openai_error_body(err: EmberError) -> dict[str, Any]:
    """OpenAI's error object (also what an SSE stream sends in-band once its status code is out)."""
    code = next((c for cls, c in _OPENAI_CODE.items() if isinstance(err, cls)), None)
    param = err.param if isinstance(err, ParamError) else ("model" if isinstance(err, ModelNotFound) else None)
    return {"error": {"message": client_message(err), "type": _OPENAI_TYPE.get(status_of(err), "server_error"),
                      "param": param, "code": code}}


def openai_error(err: EmberError) -> JSONResponse:
    return JSONResponse(openai_error_body(err), status_code=status_of(err), headers=_headers(err))


def internal_error(exc: BaseException, where: str) -> EmberError:
    """Log the unexpected exception server-side; the client gets only `internal error`."""
    log.error("unexpected error in %s", where, exc_info=exc)
    return _Internal("internal error")


class _Internal(EmberError):
    """A bug in ember: answered 500 without detail."""


_LEADING_FIELD = re.compile(r"^[A-Za-z_][\w.\[\]]*: ")


def _path(loc: tuple[int | str, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _placed(loc: tuple[int | str, ...], text: str, where: str) -> tuple[str, str]:
    """One pydantic error's line and its field. A validator's message that names a part of its own field (`[1]: ...`,
    `.key: ...`, or its field again: `input[1]: ...`) stays under that field; one that names a field within it
    (`content: ...` of `messages[0]`) is put under its place."""
    path = _path(loc)
    if text[:1] in "[.":
        return f"{path}{text}", path or where
    leaf = loc[-1] if loc else None
    if isinstance(leaf, str) and re.match(rf"{re.escape(leaf)}[\[.:]", text):
        parent = _path(loc[:-1])
        return (f"{parent}.{text}" if parent else text), path
    if _LEADING_FIELD.match(text):
        line = f"{path}.{text}" if path else text
        return line, line.split(": ", 1)[0]
    return f"{path or where}: {text}", path or where


def validation_message(err: ValidationError, where: str) -> tuple[str, str]:
    """A pydantic error as one line that starts with the field (`messages[0].content: ...`; `where` when the whole
    request is at fault), each bad field named so, and the first one's field as OpenAI's `param`."""
    placed = [_placed(tuple(e["loc"]), str(e["ctx"]["error"]) if e["type"] == "value_error" and "ctx" in e
                      else e["msg"], where) for e in err.errors()]
    return "; ".join(line for line, _ in placed), placed[0][1]


def validated(model: type[M], data: Any, where: str) -> M:
    """`data` as `model`, or a ParamError (a 400) naming the bad fields (`validation_message`)."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ParamError(*validation_message(err, where)) from None
