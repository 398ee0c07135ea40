"""What a failed forward says about delivery (ember/cluster/delivery.py, as the HTTP transport applies it): a reset
before any reply is a request the peer's process never read (NotDelivered); a clean close, a cut-off reply or
silence may follow a request it read (NodeUnreachable). And `closed_by_peer`, the look at a pooled connection before
it is written to again. tests/integration/cluster/test_forward_delivery.py runs the rule over both transports."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator

import aiohttp
import pytest

from ember.cluster.delivery import closed_by_peer, lost
from ember.cluster.forward import unanswered
from ember.errors import NodeUnreachable, NotDelivered

URL = "http://10.0.0.2:8000"


@pytest.mark.parametrize("err", [aiohttp.ClientOSError(errno.ECONNRESET, "Connection reset by peer"),
                                 aiohttp.ClientOSError(errno.EPIPE, "Broken pipe"),
                                 aiohttp.ClientConnectionResetError("Cannot write to closing transport"),
                                 ConnectionResetError(errno.ECONNRESET, "reset")])
def test_a_reset_before_any_reply_is_not_delivered_and_answered(err: BaseException) -> None:
    failed = unanswered(URL, err)
    assert isinstance(failed, NotDelivered) and failed.answered
    assert "reset the connection before answering, the request unread" in failed.message


def test_a_request_body_not_written_for_a_closed_connection_is_not_delivered() -> None:
    """aiohttp's own wrapping, as seen in bench/cluster.py's kill: the connection closed under the body's write."""
    err = aiohttp.ClientOSError(None, "Can not write request body for http://10.0.0.2:8000/cluster/infer/iris/1")
    err.__cause__ = aiohttp.ClientConnectionResetError("Cannot write to closing transport")
    assert isinstance(unanswered(URL, err), NotDelivered)
    other = aiohttp.ClientOSError(None, "something else")
    other.__cause__ = ValueError("not a reset")
    assert type(unanswered(URL, other)) is NodeUnreachable


@pytest.mark.parametrize(("err", "answered"), [(aiohttp.ServerDisconnectedError(), True),
                                               (aiohttp.ClientPayloadError("cut"), True),
                                               (aiohttp.ClientOSError(errno.ETIMEDOUT, "timed out"), False),
                                               (aiohttp.SocketTimeoutError("read"), False),
                                               (TimeoutError(), False)])
def test_a_clean_close_or_silence_may_follow_a_request_read(err: BaseException, answered: bool) -> None:
    failed = unanswered(URL, err)
    assert type(failed) is NodeUnreachable and failed.answered is answered
    assert "took the request and did not answer" in failed.message


def test_a_reset_after_the_reply_began_counts_as_delivered() -> None:
    failed = lost(URL, aiohttp.ClientOSError(errno.ECONNRESET, "Connection reset by peer"))
    assert type(failed) is NodeUnreachable and failed.answered


def test_no_connection_is_not_delivered_answered_only_when_refused() -> None:
    class Key:   # what ClientConnectorError reads of a connection key
        ssl = False
        host, port = "10.0.0.2", 8000

    refused = aiohttp.ClientConnectorError(Key(), ConnectionRefusedError(errno.ECONNREFUSED, "refused"))  # type: ignore[arg-type]
    no_route = aiohttp.ClientConnectorError(Key(), OSError(errno.EHOSTUNREACH, "no route"))  # type: ignore[arg-type]
    for err, answered in ((refused, True), (no_route, False), (aiohttp.ConnectionTimeoutError(), False)):
        failed = unanswered(URL, err)
        assert isinstance(failed, NotDelivered) and failed.answered is answered, err


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    server = socket.create_server(("127.0.0.1", 0))
    ours = socket.create_connection(server.getsockname())
    theirs, _ = server.accept()
    ours.setblocking(False)
    yield ours, theirs
    server.close()
    ours.close()
    theirs.close()


def test_an_idle_open_connection_is_not_closed(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, _ = pair
    assert not closed_by_peer(ours)


def test_a_connection_its_peer_closed_is_closed_and_the_look_takes_nothing(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    theirs.sendall(b"x")
    assert not closed_by_peer(ours)    # a byte waiting: open (a TLS record, say)
    assert ours.recv(1) == b"x"        # still there after the look
    theirs.close()
    assert closed_by_peer(ours)
    assert not ours.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)


def test_data_then_a_fin_is_closed_as_a_tls_peers_close_alert_and_fin_are(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    theirs.sendall(b"\x15\x03\x03\x00\x02\x01\x00")   # an alert record (TLS 1.3 sends it encrypted: any bytes)
    theirs.shutdown(socket.SHUT_WR)
    assert closed_by_peer(ours)
    assert ours.recv(1) == b"\x15"    # the look took nothing


def test_a_connection_its_peer_reset_is_closed(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")   # linger 0: RST
    theirs.close()
    assert closed_by_peer(ours)


def test_no_socket_is_not_closed() -> None:
    assert not closed_by_peer(None)


def test_a_socket_already_closed_here_counts_as_closed_not_an_error() -> None:
    sock = socket.socket()
    sock.close()   # its descriptor is -1 now (a link reset while idle: asyncio closed it)
    assert closed_by_peer(sock)
