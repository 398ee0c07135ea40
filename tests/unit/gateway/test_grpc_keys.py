"""The gRPC port checks a call's API key before it reads the call's message: no key, or a wrong one, is
UNAUTHENTICATED and the handler never runs; a public RPC needs none; the port's concurrency follows the budget."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from ember.core.access import Principal
from ember.gateway.auth import Auth
from ember.gateway.grpc_server import GrpcSettings, KeyCheck

SERVICE = "inference.GRPCInferenceService"


class Keys:
    def authenticate(self, key: str) -> Principal | None:
        return Principal("acme", "user") if key == "good" else None


class Api:
    """What KeyCheck asks of the API: which RPCs need a key."""

    def keyed(self, path: str) -> bool:
        return not path.endswith("/ServerLive")


async def call(metadata: tuple[tuple[str, str], ...],
               method: str = "ModelInfer") -> tuple[grpc.StatusCode, list[bytes]]:
    ran: list[bytes] = []

    async def echo(message: bytes, context: Any) -> bytes:
        ran.append(message)
        return message

    handler = grpc.method_handlers_generic_handler(SERVICE, {
        name: grpc.unary_unary_rpc_method_handler(echo) for name in ("ModelInfer", "ServerLive")})
    server = grpc.aio.server(interceptors=[KeyCheck(Auth(keys=Keys()), Api())])  # type: ignore[arg-type]
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            rpc = channel.unary_unary(f"/{SERVICE}/{method}")
            try:
                await rpc(b"x" * 1000, metadata=metadata)
            except grpc.aio.AioRpcError as err:
                return err.code(), ran
            return grpc.StatusCode.OK, ran
    finally:
        await server.stop(None)


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer bad"),), (("authorization", "good"),)],
                         ids=["no-key", "unknown-key", "not-bearer"])
def test_a_call_without_a_valid_key_is_refused_before_its_handler_runs(
        metadata: tuple[tuple[str, str], ...]) -> None:
    code, ran = asyncio.run(call(metadata))
    assert code == grpc.StatusCode.UNAUTHENTICATED and ran == []


def test_a_valid_key_or_a_public_rpc_reaches_the_handler() -> None:
    assert asyncio.run(call((("authorization", "Bearer good"),))) == (grpc.StatusCode.OK, [b"x" * 1000])
    assert asyncio.run(call((), "ServerLive")) == (grpc.StatusCode.OK, [b"x" * 1000])


def test_concurrent_calls_are_as_many_largest_messages_as_the_budget_holds() -> None:
    mb = 1 << 20
    default = GrpcSettings("h", 1, 64 * mb, max_inflight_bytes=256 * mb)   # ember serve's defaults
    assert (default.concurrent_calls, default.message_bytes) == (64, 4 * mb)   # 64 x 4 MiB: the budget
    small = GrpcSettings("h", 1, 64 * mb, max_inflight_bytes=16 * mb)
    assert (small.concurrent_calls, small.message_bytes) == (16, 1 * mb)
    assert GrpcSettings("h", 1, 2 * mb, max_inflight_bytes=1024 * mb).message_bytes == 2 * mb   # the body limit
    for s in (default, small, GrpcSettings("h", 1, 64 * mb)):
        assert s.concurrent_calls * s.message_bytes <= (s.max_inflight_bytes or s.max_body_bytes)
