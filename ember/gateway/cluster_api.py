"""The routes a peer gateway forwards a request to (issue 14): `POST /cluster/infer/{name}/{version}` and, for
streams, `POST /cluster/stream/{name}/{version}`.

A forwarded request is the caller's (ember/gateway/caller.py): it is admitted here as every route is
(`ember.gateway.auth.Auth.admit`: the caller's API key, checked on this node; its rate limit, this node's
buckets), its tenant must be the key's (`X-Ember-Tenant`; with keys off it stamps the jobs it becomes), the
model must be one the tenant may see, and its trace continues from the forwarding gateway's span. On a TLS
gateway (`--tls-dir`) the routes also need the connection to be another node's (a client certificate the
cluster CA issued: ember/gateway/connections.py), so a client cannot call them past its own gateway's checks.

Bodies are tensor bundles (`ember.wire.bundle.pack`); answers are the outputs packed the same way (200), a job
(202, JSON) or an error as JSON naming its class, so the forwarding gateway raises the same EmberError.
A stream answers as `infer` does until it is open (an error before it: JSON with its status code), then 200
with the replies as frames (`ember.wire.cluster.FrameDecoder`): each reply as it comes, then END, or an ERROR
frame. The forwarding gateway closing the connection (its client went away) cancels the body's generator here,
which withdraws the request from its instance, as a local client's disconnect does.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from typing import Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ember.errors import EmberError, Forbidden, InvalidInput, error_fields
from ember.gateway.app import guarded_route
from ember.gateway.auth import TenantView
from ember.gateway.caller import TENANT_HEADER
from ember.gateway.context import gateway_of, until_disconnected
from ember.gateway.errors import status_of
from ember.gateway.limits import read_body
from ember.serving.results import InferResult, InferStream, JobAccepted
from ember.tls import PEER_SCOPE_KEY
from ember.wire import bundle
from ember.wire.cluster import END, error_frame, frame, reply_frame
from ember.wire.contract import ModelContract
from ember.wire.refs import NAME_PATTERN
from ember.wire.tensors import Tensors

BINARY = ("application/octet-stream",)


class ForwardedHost(Protocol):
    async def serve_forwarded(self, contract: ModelContract, inputs: Tensors,
                              tenant: str | None) -> InferResult | JobAccepted:
        """Serve on this node (starting the model here if the controller placed it here)."""

    async def serve_stream(self, contract: ModelContract, inputs: Tensors, tenant: str | None) -> InferStream:
        """Open a stream on this node (starting the model here if the cluster placed it here)."""


def error_body(err: EmberError) -> JSONResponse:
    return JSONResponse(error_fields(err), status_code=status_of(err))


def caller_tenant(request: Request) -> str | None:
    """The tenant the request is for: the admitted key's (a different `X-Ember-Tenant` is refused), or with keys
    off the header's (None without one)."""
    given = request.headers.get(TENANT_HEADER)
    service = gateway_of(request).service
    if isinstance(service, TenantView):
        if given is not None and given != service.principal.tenant:
            raise Forbidden(f"{TENANT_HEADER}: {given[:100]!r} is not the API key's tenant")
        return service.principal.tenant
    if given is not None and not re.fullmatch(NAME_PATTERN, given):
        raise InvalidInput(f"{TENANT_HEADER}: {given[:100]!r} is not a tenant name")
    return given


async def _frames(stream: InferStream) -> AsyncIterator[bytes]:
    try:
        async for outputs in stream:
            yield reply_frame(outputs)
        yield frame(END)
    except EmberError as err:   # after the status code a failure can only be a frame
        yield error_frame(err)
    finally:
        stream.on_close()       # synchronous: a disconnect cancels this generator at its next await
        with contextlib.suppress(BaseException):
            await stream.aclose()


def cluster_routes(host: ForwardedHost, *, nodes_only: bool = False) -> list[Route]:
    """`nodes_only`: a TLS gateway's, whose cluster routes take only connections from another node."""

    async def admitted(request: Request) -> tuple[ModelContract, Tensors]:
        if nodes_only and request.scope.get(PEER_SCOPE_KEY) is None:
            raise Forbidden(f"{request.url.path}: a route for the cluster's nodes (a connection with a node "
                            "certificate of the cluster's CA)")
        request.state.model = f"{request.path_params['name']}:{request.path_params['version']}"
        contract = gateway_of(request).service.contract(request.path_params["name"], request.path_params["version"])
        return contract, bundle.unpack(await read_body(request, gateway_of(request).max_body_bytes), "cluster body")

    async def infer(request: Request) -> Response:
        contract, inputs = await admitted(request)
        result = await host.serve_forwarded(contract, inputs, caller_tenant(request))
        if isinstance(result, JobAccepted):
            return JSONResponse({"job_id": result.job_id, "retry_after": result.retry_after}, status_code=202)
        return Response(bundle.pack(result.outputs), media_type="application/octet-stream",
                        headers={"x-ember-rung": result.rung.value, "x-ember-instance": result.instance_id})

    async def stream(request: Request) -> Response:
        contract, inputs = await admitted(request)
        opened = await until_disconnected(request, host.serve_stream(contract, inputs, caller_tenant(request)))
        return StreamingResponse(_frames(opened), media_type="application/octet-stream",
                                 headers={"x-ember-rung": opened.rung.value, "x-ember-instance": opened.instance_id})

    return [guarded_route("/cluster/infer/{name}/{version}", "cluster", infer, error_body, post=True,
                          accepts=BINARY),
            guarded_route("/cluster/stream/{name}/{version}", "cluster", stream, error_body, post=True,
                          accepts=BINARY)]
