"""The route a peer gateway forwards a request to (issue 14): `POST /cluster/infer/{name}/{version}`.

Not for clients: it takes the cluster's token (`X-Ember-Cluster-Token`, handed to every node in the
controller's view) instead of an API key, since the forwarding gateway has already admitted the request.
Bodies are `ember.wire.cluster.pack_tensors`'s; answers are the outputs packed the same way (200), a job
(202, JSON) or an error as JSON naming its class, so the forwarding gateway raises the same EmberError.
"""

from __future__ import annotations

import secrets
from typing import Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.errors import EmberError, Forbidden
from ember.gateway.errors import status_of
from ember.serving.results import InferResult, JobAccepted
from ember.wire.cluster import pack_tensors, unpack_tensors
from ember.wire.tensors import Tensors

TOKEN_HEADER = "x-ember-cluster-token"


class ForwardedHost(Protocol):
    def cluster_token(self) -> str | None:
        """The cluster's token (None until this node has joined)."""

    async def serve_forwarded(self, name: str, version: str, inputs: Tensors) -> InferResult | JobAccepted:
        """Serve on this node (starting the model here if the controller placed it here)."""


def error_body(err: EmberError) -> JSONResponse:
    return JSONResponse({"kind": type(err).__name__, "message": err.message,
                         "retry_after": getattr(err, "retry_after", None)}, status_code=status_of(err))


def cluster_routes(host: ForwardedHost) -> list[Route]:
    async def infer(request: Request) -> Response:
        token = host.cluster_token()
        given = request.headers.get(TOKEN_HEADER, "")
        if token is None or not secrets.compare_digest(given.encode(), token.encode()):
            return error_body(Forbidden("cluster route: a missing or wrong cluster token"))
        try:
            inputs = unpack_tensors(await request.body())
            result = await host.serve_forwarded(request.path_params["name"], request.path_params["version"], inputs)
        except EmberError as err:
            return error_body(err)
        if isinstance(result, JobAccepted):
            return JSONResponse({"job_id": result.job_id, "retry_after": result.retry_after}, status_code=202)
        return Response(pack_tensors(result.outputs), media_type="application/octet-stream",
                        headers={"x-ember-rung": result.rung.value, "x-ember-instance": result.instance_id})

    return [Route("/cluster/infer/{name}/{version}", infer, methods=["POST"])]
