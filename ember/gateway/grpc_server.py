"""The gRPC port (`ember serve --grpc-port`, 8001 by default, 0: none): a grpc.aio server on the gateway's own event
loop, serving `ember.gateway.grpc_api` over the same app as the HTTP port, started once that port is bound and
stopped with it (new calls refused at once, those running given the shutdown grace).

Messages up to the gateway's max_body_bytes are read (a larger one is RESOURCE_EXHAUSTED); answers have no limit of
their own (their size is the model's). On a TLS gateway (`--tls-dir`) the port speaks TLS with the node's
certificate. The port is this server's alone (no SO_REUSEPORT, which would share its calls with another server):
a port asked for (`--grpc-port`, `$EMBER_GRPC_PORT`) that is taken fails the start; the default one taken (a
second server on the host) is a warning, and that server has no gRPC port.

With API keys on, a call's `authorization` metadata is checked before its message is read (`KeyCheck`): a caller
without a valid key is UNAUTHENTICATED having sent nothing the server holds. The calls served at once, and the
requests of one stream answered at once, are at most the in-flight budget over the largest message
(`max_inflight_bytes // max_body_bytes`, at least 1); more calls are refused RESOURCE_EXHAUSTED by gRPC, more requests
on a stream wait unread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from starlette.applications import Starlette

from ember.errors import InvalidInput, Unauthenticated
from ember.gateway.auth import Auth
from ember.gateway.grpc_api import GrpcApi
from ember.tls import NodeTls

log = logging.getLogger("ember.gateway")

# A message holds its tensors and a little framing (names, shapes, datatypes): room for that beyond the body limit,
# so that the gateway's own check, which names max_body_bytes, is what refuses a tensor too large.
FRAMING_BYTES = 64 * 1024


CONCURRENT_CALLS = 64   # gRPC calls at once: many small tensors' clients; their messages share the body budget


@dataclass(frozen=True)
class GrpcSettings:
    host: str
    port: int
    max_body_bytes: int
    tls_dir: Path | None = None
    required: bool = True   # False (the default port, not asked for): a port taken is a warning, and no gRPC
    max_inflight_bytes: int | None = None   # the in-flight body budget (None: max_body_bytes, one call at once)

    @property
    def message_bytes(self) -> int:
        """The largest message a call may send: the in-flight budget shared by CONCURRENT_CALLS (at the default
        256 MB, gRPC's own default of 4 MiB), within the HTTP body limit, and at least 1 MiB. gRPC reads a message
        whole before any handler runs, so this and `concurrent_calls` bound what the port holds at once."""
        budget = self.max_inflight_bytes or self.max_body_bytes
        return min(self.max_body_bytes, max(1 << 20, budget // CONCURRENT_CALLS))

    @property
    def concurrent_calls(self) -> int:
        """The calls (and requests of one stream) served at once: as many largest messages as the budget holds, at
        most CONCURRENT_CALLS (a call past them is RESOURCE_EXHAUSTED; below them, small calls are never refused)."""
        budget = self.max_inflight_bytes or self.max_body_bytes
        return max(1, min(CONCURRENT_CALLS, budget // self.message_bytes))


class KeyCheck(grpc.aio.ServerInterceptor):
    """With API keys on, a keyed RPC's `authorization` metadata is checked before its message is read: without a
    valid key the call is UNAUTHENTICATED and its handler never runs (the guard still admits the key's role)."""

    def __init__(self, auth: Auth, api: GrpcApi) -> None:
        self.auth, self.api = auth, api

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        if self.auth.enabled and self.api.keyed(details.method):
            metadata = dict(details.invocation_metadata or ())
            try:
                self.auth.check_key(metadata.get("authorization"))
            except Unauthenticated as err:
                return _refusal(err.message)
        return await continuation(details)


def _refusal(message: str) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler that refuses at once, reading no message (a streaming handler is not handed one before it asks)."""

    async def refuse(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.stream_stream_rpc_method_handler(refuse)


class GrpcServer:
    def __init__(self, app: Starlette, settings: GrpcSettings) -> None:
        self.app, self.settings = app, settings
        self._server: Any = None
        self.port: int | None = None   # once bound

    async def start(self) -> None:
        """Bind and serve; InvalidInput naming the port when it cannot be bound."""
        s = self.settings
        api = GrpcApi(self.app, s.concurrent_calls)
        server = grpc.aio.server(interceptors=[KeyCheck(api.gateway.auth, api)],
                                 maximum_concurrent_rpcs=s.concurrent_calls, options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", s.message_bytes + FRAMING_BYTES),
            ("grpc.max_send_message_length", -1),
            ("grpc.max_concurrent_streams", s.concurrent_calls),
        ])
        server.add_generic_rpc_handlers((api.handler(),))
        address = f"[{s.host}]:{s.port}" if ":" in s.host else f"{s.host}:{s.port}"
        try:
            if s.tls_dir is None:
                self.port = server.add_insecure_port(address)
            else:
                self.port = server.add_secure_port(address, _credentials(NodeTls.of(s.tls_dir)))
        except RuntimeError as err:
            if s.required:
                raise InvalidInput(f"grpc_port: cannot bind {address} ({err}); another server may hold it "
                                   "(--grpc-port N, or 0 for no gRPC)") from None
            log.warning("no gRPC port: the default, %s, cannot be bound (another server holds it?); "
                        "--grpc-port N gives this server one", address)
            return
        await server.start()
        self._server = server
        log.info("KServe V2 gRPC on %s://%s", "grpcs" if s.tls_dir else "grpc", address)

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls now; those running get `grace_s`, then are cancelled."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None


def _credentials(tls: NodeTls) -> Any:
    return grpc.ssl_server_credentials([(tls.key.read_bytes(), tls.cert.read_bytes())])
