"""A stream forwarded between gateways: the peer's `POST /cluster/stream/...` route (on a real uvicorn on
loopback, in the gateway's app, over a fake host) and the forwarding side's `Forwarder.stream`, with real aiohttp
between them. (Mutual TLS and the caller's key on these routes: tests/integration/cluster/test_secured_links.py.)"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

pytest.importorskip("aiohttp")

from ember.cluster.forward import Forwarder
from ember.core.states import Rung
from ember.errors import ModelFailed, ModelNotFound, NodeUnreachable, Overloaded
from ember.gateway.app import create_app
from ember.gateway.cluster_api import cluster_routes
from ember.metrics import Metrics
from ember.serving.results import InferResult, InferStream, JobAccepted
from ember.testing.asgi import ThreadedServer
from ember.testing.service import FakeService
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors


@dataclass
class Host:
    """Streams `n` replies (x + i), `delay_s` apart; `fail` ends the stream after `fail_at` replies: "model" with
    ModelFailed, "cut" by dropping the connection as a dying peer does; `refuse` is raised before it opens."""

    n: int = 3
    delay_s: float = 0.0
    fail: str = ""
    fail_at: int = 1
    refuse: Exception | None = None
    closed: threading.Event = field(default_factory=threading.Event)
    sent: int = 0

    async def serve_forwarded(self, contract: ModelContract, inputs: Tensors,
                              tenant: str | None) -> InferResult | JobAccepted:
        raise AssertionError("not a unary test")

    async def serve_stream(self, contract: ModelContract, inputs: Tensors, tenant: str | None = None) -> InferStream:
        if self.refuse is not None:
            raise self.refuse
        return InferStream(Rung.HOT, "i-1", self._replies(inputs["x"]))

    async def _replies(self, x: np.ndarray) -> AsyncGenerator[Tensors, None]:
        try:
            for i in range(self.n):
                if i == self.fail_at and self.fail == "model":
                    raise ModelFailed("the model raised")
                if i == self.fail_at and self.fail == "cut":
                    raise RuntimeError("the peer died")   # uvicorn drops the connection mid-body
                await asyncio.sleep(self.delay_s)
                self.sent += 1
                yield {"y": x + i}
        finally:
            self.closed.set()


@pytest.fixture
def peer() -> Iterator[tuple[Host, str]]:
    host = Host()
    app = create_app(FakeService(models=[CONTRACT]), Metrics())
    app.router.routes.extend(cluster_routes(host))
    with ThreadedServer(app, log_level="critical") as server:
        yield host, server.url


CONTRACT = ModelContract.model_validate({
    "name": "m", "version": "1", "runtime": "python", "entrypoint": "m:M",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}]})
ABSENT = CONTRACT.model_copy(update={"name": "absent"})


async def collect(url: str, contract: ModelContract = CONTRACT) -> tuple[InferStream, list[float], Exception | None]:
    forwarder = Forwarder(5)
    got: list[float] = []
    try:
        stream = await forwarder.stream(url, contract, {"x": np.array([1.0], np.float32)}, {})
        try:
            async for reply in stream:
                got.append(float(reply["y"][0]))
        except Exception as err:
            return stream, got, err
        return stream, got, None
    finally:
        await forwarder.close()


def test_the_replies_come_back_in_order_with_where_they_were_served(peer: tuple[Host, str]) -> None:
    stream, got, err = asyncio.run(collect(peer[1]))
    assert (stream.rung, stream.instance_id, got, err) == (Rung.HOT, "i-1", [1.0, 2.0, 3.0], None)


def test_an_error_before_the_stream_opens_is_raised_as_the_peers_class(peer: tuple[Host, str]) -> None:
    peer[0].refuse = Overloaded("every instance is full", retry_after=2.5)
    with pytest.raises(Overloaded, match="every instance is full") as caught:
        asyncio.run(collect(peer[1]))
    assert caught.value.retry_after == 2.5
    with pytest.raises(ModelNotFound, match="absent"):   # a model the serving node does not know
        asyncio.run(collect(peer[1], ABSENT))


@pytest.mark.parametrize(("fail", "raised"), [("model", ModelFailed), ("cut", NodeUnreachable)])
def test_a_failure_mid_stream_ends_it_with_that_error_after_the_replies_sent(
        peer: tuple[Host, str], fail: str, raised: type[Exception]) -> None:
    peer[0].fail = fail
    _, got, err = asyncio.run(collect(peer[1]))
    assert got == [1.0] and isinstance(err, raised)


@pytest.mark.parametrize(("fail", "raised"), [("model", ModelFailed), ("cut", NodeUnreachable)])
def test_a_failure_before_the_first_reply_is_raised_by_stream_itself_so_it_can_be_retried(
        peer: tuple[Host, str], fail: str, raised: type[Exception]) -> None:
    """Nothing has reached the client: the caller may retry it elsewhere (a cut) or answer the model's error with
    its status code, not a 200 and an error event."""
    peer[0].fail, peer[0].fail_at = fail, 0
    with pytest.raises(raised):
        asyncio.run(collect(peer[1]))
    assert peer[0].closed.wait(5)


def test_a_peer_that_is_not_there_is_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]   # closed again before the request: nothing listens there
    with pytest.raises(NodeUnreachable):
        asyncio.run(collect(f"http://127.0.0.1:{port}"))


def test_closing_the_stream_withdraws_it_on_the_peer(peer: tuple[Host, str]) -> None:
    host, url = peer
    host.n, host.delay_s = 1000, 0.02

    async def first_then_close() -> None:
        forwarder = Forwarder(5)
        stream = await forwarder.stream(url, CONTRACT, {"x": np.array([1.0], np.float32)}, {})
        async for _ in stream:
            break
        stream.on_close()
        await stream.aclose()
        await forwarder.close()

    asyncio.run(first_then_close())
    assert host.closed.wait(5), "the peer's stream was not closed"
    assert host.sent < 1000


def test_cutting_a_peer_that_left_ends_its_open_streams_as_unreachable(peer: tuple[Host, str]) -> None:
    """A peer machine that falls silent resets no connection: when it leaves the view, its streams are cut."""
    host, url = peer
    host.n, host.delay_s = 1000, 0.02

    async def cut_after_one() -> tuple[list[float], Exception | None, int]:
        forwarder = Forwarder(5)
        stream = await forwarder.stream(url, CONTRACT, {"x": np.array([1.0], np.float32)}, {})
        got: list[float] = []
        try:
            async for reply in stream:
                got.append(float(reply["y"][0]))
                cut = forwarder.cut(url)
        except Exception as err:
            return got, err, cut
        finally:
            await forwarder.close()
        return got, None, cut

    got, err, cut = asyncio.run(cut_after_one())
    assert cut == 1 and 1 <= len(got) < 10 and isinstance(err, NodeUnreachable)
    assert host.closed.wait(5) and host.sent < 1000   # the peer saw the connection go
