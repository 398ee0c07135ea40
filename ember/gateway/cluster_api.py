"""The routes a peer gateway forwards a request to (issue 14): `POST /cluster/infer/{name}/{version}` and, for
streams, `POST /cluster/stream/{name}/{version}`.

Not for clients: it takes the cluster's token (`X-Ember-Cluster-Token`, handed to every node in the
controller's view) instead of an API key, since the forwarding gateway has already admitted the request.
Bodies are `ember.wire.cluster.pack_tensors`'s; answers are the outputs packed the same way (200), a job
(202, JSON) or an error as JSON naming its class, so the forwarding gateway raises the same EmberError.
A stream answers as `infer` does until it is open (an error before it: JSON with its status code), then 200
with the replies as frames (`ember.wire.cluster.FrameDecoder`): each reply as it comes, then END, or an ERROR
frame. The forwarding gateway closing the connection (its client went away) cancels the body's generator here,
which withdraws the request from its instance, as a local client's disconnect does.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ember.errors import EmberError, Forbidden
from ember.gateway.context import until_disconnected
from ember.gateway.errors import status_of
from ember.serving.results import InferResult, InferStream, JobAccepted
from ember.wire.cluster import END, error_frame, frame, pack_tensors, reply_frame, unpack_tensors
from ember.wire.tensors import Tensors

TOKEN_HEADER = "x-ember-cluster-token"


class ForwardedHost(Protocol):
    def cluster_token(self) -> str | None:
        """The cluster's token (None until this node has joined)."""

    async def serve_forwarded(self, name: str, version: str, inputs: Tensors) -> InferResult | JobAccepted:
        """Serve on this node (starting the model here if the controller placed it here)."""

    async def serve_stream(self, name: str, version: str, inputs: Tensors) -> InferStream:
        """Open a stream on this node (starting the model here if the cluster placed it here)."""


def error_body(err: EmberError) -> JSONResponse:
    return JSONResponse({"kind": type(err).__name__, "message": err.message,
                         "retry_after": getattr(err, "retry_after", None)}, status_code=status_of(err))


def _admitted(host: ForwardedHost, request: Request) -> bool:
    token = host.cluster_token()
    given = request.headers.get(TOKEN_HEADER, "")
    return token is not None and secrets.compare_digest(given.encode(), token.encode())


async def _frames(stream: InferStream) -> AsyncIterator[bytes]:
    try:
        async for outputs in stream:
            yield reply_frame(outputs)
        yield frame(END)
    except EmberError as err:   # after the status code a failure can only be a frame
        yield error_frame(type(err).__name__, err.message, getattr(err, "retry_after", None))
    finally:
        stream.on_close()       # synchronous: a disconnect cancels this generator at its next await
        with contextlib.suppress(BaseException):
            await stream.aclose()


def cluster_routes(host: ForwardedHost) -> list[Route]:
    refused = Forbidden("cluster route: a missing or wrong cluster token")

    async def infer(request: Request) -> Response:
        if not _admitted(host, request):
            return error_body(refused)
        try:
            inputs = unpack_tensors(await request.body())
            result = await host.serve_forwarded(request.path_params["name"], request.path_params["version"], inputs)
        except EmberError as err:
            return error_body(err)
        if isinstance(result, JobAccepted):
            return JSONResponse({"job_id": result.job_id, "retry_after": result.retry_after}, status_code=202)
        return Response(pack_tensors(result.outputs), media_type="application/octet-stream",
                        headers={"x-ember-rung": result.rung.value, "x-ember-instance": result.instance_id})

    async def stream(request: Request) -> Response:
        if not _admitted(host, request):
            return error_body(refused)
        try:
            inputs = unpack_tensors(await request.body())
            opened = await until_disconnected(request, host.serve_stream(request.path_params["name"],
                                                                         request.path_params["version"], inputs))
        except EmberError as err:
            return error_body(err)
        return StreamingResponse(_frames(opened), media_type="application/octet-stream",
                                 headers={"x-ember-rung": opened.rung.value, "x-ember-instance": opened.instance_id})

    return [Route("/cluster/infer/{name}/{version}", infer, methods=["POST"]),
            Route("/cluster/stream/{name}/{version}", stream, methods=["POST"])]
