"""Who is calling, and may they: cross-site refusal, API keys, roles, tenant views and rate limits.

Every route is wrapped by `ember.gateway.app._guard`, which calls `Auth.admit` before the handler, in
this order (the first refusal answers):

0. A `Host` that is not a name this server answers to (`HostCheck`, `--allowed-hosts`) → 403, on every
   route but the public ones (health, server metadata, the UI's page and files: probes may name anything).
   A DNS rebinding page (an attacker's name made to resolve to this server) sends its own name as `Host` and
   as `Origin`, which step 1 alone would take for a same-site request.
1. A state-changing request (not GET/HEAD/OPTIONS) whose `Origin` is not this server's own host → 403.
   Browsers send `Origin` on every cross-site POST; API clients send none.
2. A POST whose `Content-Type` is not one its route takes (JSON; V2 infer also binary) → 415. A page on
   another site can POST `text/plain` or a form without a CORS preflight; no JSON route takes those.
   A request with no Content-Type at all is let through (tritonclient sends none). JSON is UTF-8 (RFC 8259
   section 8.1): a `charset` other than UTF-8 → 415, as is a body in UTF-16 or UTF-32 (`v2_codec.parse_json_object`).
3. With authentication on, routes other than health, server metadata and the UI's static files need
   `Authorization: Bearer <key>`: missing, malformed, unknown or revoked → 401 with `WWW-Authenticate`.
4. Admin routes (repository load/unload, /metrics, /ember/status, /ui/data) refuse a `user` key → 403.
   Peer routes (a node's weight-store chunks, read by the other nodes) take an admin key, a connection from
   another node (a client certificate of the cluster's CA, on a TLS gateway: ember/tls.py) or, on plain links,
   the cluster token (`--cluster-token`, `$EMBER_CLUSTER_TOKEN`), which opens no other route.
5. The tenant's token bucket (when rate limits are on) refuses → 429 with `Retry-After`.

An admitted principal sees the service through `TenantView`: other tenants' models do not exist for it
(404 with the same message as a model that is not deployed), nor do other tenants' jobs, and the jobs it
submits are stamped with its tenant.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from starlette.requests import Request

from ember.clock import SystemClock
from ember.core.access import Access, Principal, may_enter, may_see, owns_job
from ember.core.clock import Clock
from ember.core.ratelimit import RateLimiter
from ember.errors import Forbidden, JobNotFound, ModelNotFound, RateLimited, Unauthenticated, UnsupportedMediaType
from ember.gateway.service import Service
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
from ember.tls import PEER_SCOPE_KEY
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
JSON = ("application/json",)
JSON_OR_BINARY = ("application/json", "application/octet-stream")
_DEFAULT_PORT = {"http": 80, "https": 443}


@dataclass(frozen=True)
class HostCheck:
    """The `Host` names this server answers to: any IP literal (a rebinding page's Host is always its own DNS
    name, never an address), `names` (lower case, no trailing dot) and names ending in one of `suffixes`
    (".example.com"). A request without Host (HTTP/1.0) passes: browsers always send one."""

    names: frozenset[str]
    suffixes: tuple[str, ...] = ()

    @classmethod
    def of(cls, entries: Iterable[str]) -> HostCheck:
        names = {e.strip().lower().rstrip(".") for e in entries if e.strip()}
        return cls(frozenset(n for n in names if not n.startswith(".")),
                   tuple(sorted(n for n in names if n.startswith("."))))

    def allows(self, host_header: str) -> bool:
        found = _host_port(host_header, None)
        if found is None:
            return False
        name = found[0].rstrip(".")
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            pass
        return bool(name) and (name in self.names or name.endswith(self.suffixes))

    def check(self, request: Request) -> None:
        host = request.headers.get("host")
        if host is not None and not self.allows(host):
            raise Forbidden(f"Host: {host[:100]!r} is not a name this server answers to (DNS rebinding?); "
                            f"the server's --allowed-hosts adds names")


class KeyLookup(Protocol):
    def authenticate(self, key: str) -> Principal | None:
        """The key's principal; None for an unknown, revoked or malformed key."""


@dataclass
class Auth:
    """The gateway's admission rules. `keys` None: authentication off (no principal, no tenant views)."""

    keys: KeyLookup | None = None
    limiter: RateLimiter | None = None
    clock: Clock = field(default_factory=SystemClock)
    cluster_token: str | None = field(default=None, repr=False)   # what peers send on PEER routes
    hosts: HostCheck | None = None   # None: any Host (keys on, or --allowed-hosts '*')

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def admit(self, request: Request, access: Access, accepts: tuple[str, ...] = JSON) -> Principal | None:
        """The caller's principal (None with authentication off), or the refusal as an EmberError."""
        if self.hosts is not None and access is not Access.PUBLIC:   # health, metadata, the UI's page: nothing to take
            self.hosts.check(request)
        if request.method not in SAFE_METHODS:
            check_origin(request)
            check_media_type(request, accepts)
        if access is Access.PUBLIC or (access is Access.PEER and self._is_peer(request)):
            return None   # a peer is not rate limited: it fetches for a node's cold start
        principal = self._principal(request)
        if not may_enter(principal, access):
            raise Forbidden(f"{request.method} {request.url.path}: needs an admin key")
        if self.limiter is not None:
            tenant = principal.tenant if principal is not None else ""
            verdict = self.limiter.admit(tenant, self.clock.now())
            if not verdict.allowed:
                raise RateLimited(f"rate limit: over {self.limiter.limit.rate:g} requests/s "
                                  f"(burst {self.limiter.limit.burst}) for this tenant",
                                  retry_after=verdict.retry_after_s)
        return principal

    def _is_peer(self, request: Request) -> bool:
        if request.scope.get(PEER_SCOPE_KEY) is not None:   # a node's certificate, verified by the handshake
            return True
        if not self.cluster_token:
            return False
        scheme, _, key = request.headers.get("authorization", "").strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.cluster_token.encode())

    def _principal(self, request: Request) -> Principal | None:
        return self.check_key(request.headers.get("authorization"))

    def check_key(self, header: str | None) -> Principal | None:
        """The principal of an `Authorization` value's key (None with authentication off), or Unauthenticated. No
        role or rate limit: a gRPC stream checks its key once, as it opens (each request on it is admitted whole)."""
        if self.keys is None:
            return None
        if not header:
            raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("Authorization: expected 'Bearer <key>'")
        principal = self.keys.authenticate(key.strip())
        if principal is None:
            raise Unauthenticated("invalid API key (unknown or revoked)")
        return principal


def _host_port(netloc: str, default_port: int | None) -> tuple[str, int | None] | None:
    try:
        parts = urlsplit("//" + netloc)
        return (parts.hostname or "").lower(), parts.port or default_port
    except ValueError:
        return None


def check_origin(request: Request) -> None:
    """A browser's cross-site request (an Origin that is not the Host it was sent to) is refused."""
    origin = request.headers.get("origin")
    if origin is None:
        return
    parts = urlsplit(origin.strip())
    default = _DEFAULT_PORT.get(parts.scheme)
    ours = _host_port(request.headers.get("host", ""), default)
    theirs = _host_port(parts.netloc, default) if parts.scheme in _DEFAULT_PORT else None
    if theirs is None or not theirs[0] or theirs != ours:
        raise Forbidden(f"Origin: {origin[:100]!r} is not this server; cross-site requests may not change state")


def check_media_type(request: Request, accepts: tuple[str, ...]) -> None:
    ctype = request.headers.get("content-type")
    if ctype is None:
        return
    media = ctype.split(";")[0].strip().lower()
    if media not in accepts:
        raise UnsupportedMediaType(f"Content-Type: {media[:100]!r} is not accepted here; send "
                                   + " or ".join(accepts))
    charset = next((v.strip().strip('"').lower() for k, _, v in (p.partition("=") for p in ctype.split(";")[1:])
                    if k.strip().lower() == "charset"), "utf-8")
    if media == "application/json" and charset not in ("utf-8", "utf8"):
        raise UnsupportedMediaType(f"Content-Type: charset={charset[:40]!r}: JSON is taken in UTF-8 only "
                                   "(RFC 8259 section 8.1)")


class TenantView:
    """The service as one principal may see it (implements Service)."""

    def __init__(self, inner: Service, principal: Principal) -> None:
        self.inner, self.principal = inner, principal

    def _visible(self, owner: str | None) -> bool:
        return may_see(self.principal, owner)

    def contracts(self) -> list[ModelContract]:
        return [c for c in self.inner.contracts() if self._visible(c.tenant)]

    def contract(self, name: str, version: str | None = None) -> ModelContract:
        contract = self.inner.contract(name, version)
        if not self._visible(contract.tenant):
            raise ModelNotFound.absent(name, version)
        return contract

    def model_ready(self, name: str, version: str | None = None) -> bool:
        return self.inner.model_ready(self.contract(name, version).name, version)

    def server_ready(self) -> bool:
        return self.inner.server_ready()

    async def infer(
        self, contract: ModelContract, inputs: Tensors, *, respond_async: bool = False, when_full: WhenFull = "job",
        tenant: str | None = None, idempotency_key: str | None = None,
    ) -> InferResult | JobAccepted:
        return await self.inner.infer(contract, inputs, respond_async=respond_async, when_full=when_full,
                                      tenant=self.principal.tenant, idempotency_key=idempotency_key)

    async def stream(self, contract: ModelContract, inputs: Tensors, *, when_full: WhenFull = "reject",
                     tenant: str | None = None, on_claim: OnClaim | None = None) -> InferStream:
        return await self.inner.stream(contract, inputs, when_full=when_full, tenant=self.principal.tenant,
                                       on_claim=on_claim)

    def job(self, job_id: str) -> JobStatus:
        job = self.inner.job(job_id)
        if not owns_job(self.principal, job.tenant):
            raise JobNotFound.unknown(job_id)
        return job

    def repository_index(self) -> list[RepositoryEntry]:
        return [e for e in self.inner.repository_index() if self._visible(e.tenant)]

    async def load_model(self, name: str) -> None:
        await self.inner.load_model(name)

    async def unload_model(self, name: str) -> None:
        await self.inner.unload_model(name)

    def status(self) -> list[ModelStatus]:
        visible = {c.key for c in self.contracts()}
        return [m for m in self.inner.status() if f"{m.name}:{m.version}" in visible]

    async def node_status(self) -> dict[str, Any]:
        return await self.inner.node_status()
