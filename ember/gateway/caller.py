"""The caller of the request being served, as a forwarding gateway passes it on to the node that serves it.

`_guard` (ember/gateway/app.py) sets it once a request is admitted; a forwarded request (ember/cluster/forward.py)
carries it as headers: the caller's own `Authorization` (the serving node checks the key itself), its tenant
(`X-Ember-Tenant`: the key's, or none with keys off) and its trace context (W3C `traceparent`/`tracestate`:
the forwarding gateway's request span when tracing is on, else the caller's own, passed through).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass

TENANT_HEADER = "x-ember-tenant"
TRACE_HEADERS = ("traceparent", "tracestate")


@dataclass(frozen=True)
class Caller:
    authorization: str | None = None
    tenant: str | None = None
    trace: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, headers: Mapping[str, str], tenant: str | None, trace: Mapping[str, str]) -> Caller:
        """From the request's headers; `trace`: the current span's context headers ({}: tracing off, the
        caller's own are passed on)."""
        passed = trace or {k: headers[k] for k in TRACE_HEADERS if k in headers}
        return cls(headers.get("authorization"), tenant, tuple(sorted(passed.items())))

    def headers(self) -> dict[str, str]:
        out = dict(self.trace)
        if self.authorization is not None:
            out["authorization"] = self.authorization
        if self.tenant is not None:
            out[TENANT_HEADER] = self.tenant
        return out


_CALLER: ContextVar[Caller | None] = ContextVar("ember_caller", default=None)


def set_caller(caller: Caller) -> None:
    """For the rest of this request's task (each request runs in a task of its own)."""
    _CALLER.set(caller)


def forwarded_headers() -> dict[str, str]:
    """The headers a request forwarded now carries ({} outside a request: a job, a tick)."""
    caller = _CALLER.get()
    return {} if caller is None else caller.headers()
