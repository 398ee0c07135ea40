"""A request sent to a peer node's gateway over HTTP (httpx), and its answer or error brought back."""

from __future__ import annotations

import httpx

import ember.errors as errors
from ember.core.states import Rung
from ember.errors import EmberError, NodeUnreachable, WorkerCrashed
from ember.gateway.cluster_api import TOKEN_HEADER
from ember.serving.results import InferResult, JobAccepted
from ember.wire.cluster import pack_tensors, unpack_tensors
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors


def _error(body: object, status: int) -> EmberError:
    """The peer's error as the same EmberError class (by name), WorkerCrashed when it is not one of ours."""
    kind = body.get("kind") if isinstance(body, dict) else None
    message = str(body.get("message")) if isinstance(body, dict) else f"peer answered {status}"
    cls = getattr(errors, str(kind), None)
    if not (isinstance(cls, type) and issubclass(cls, EmberError)):
        return WorkerCrashed(f"peer gateway answered {status}: {message}")
    retry = body.get("retry_after") if isinstance(body, dict) else None
    if issubclass(cls, errors.Overloaded | errors.JobStoreError) and isinstance(retry, int | float):
        return cls(message, retry)
    try:
        return cls(message)
    except TypeError:   # a class that wants more than a message
        return WorkerCrashed(message)


class Forwarder:
    """One pooled HTTP client to every peer gateway."""

    def __init__(self, timeout_s: float) -> None:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=2.0),
                                         limits=httpx.Limits(max_keepalive_connections=64))

    async def infer(self, url: str, token: str, contract: ModelContract, inputs: Tensors) -> InferResult | JobAccepted:
        """Raises NodeUnreachable when the peer is not there or cut the request off; the peer's own errors as
        they were raised there."""
        try:
            reply = await self._client.post(f"{url}/cluster/infer/{contract.name}/{contract.version}",
                                            content=pack_tensors(inputs), headers={TOKEN_HEADER: token})
        except (httpx.TransportError, httpx.RemoteProtocolError) as err:
            raise NodeUnreachable(f"node {url}: {type(err).__name__}: {err}") from None
        if reply.status_code == 200:
            return InferResult(unpack_tensors(reply.content), Rung(reply.headers["x-ember-rung"]),
                               reply.headers["x-ember-instance"])
        try:
            body = reply.json()
        except ValueError:
            body = None
        if reply.status_code == 202 and isinstance(body, dict):
            return JobAccepted(str(body["job_id"]), float(body["retry_after"]))
        raise _error(body, reply.status_code)

    async def close(self) -> None:
        await self._client.aclose()
