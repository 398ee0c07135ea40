"""A real `ember serve` under clients that hold its resources: many large bodies at once (admitted by bytes in
flight: 429 past the budget), sockets that send nothing or send slowly (closed after the header timeout, capped
below the open-files limit), bodies that stall (408). Status codes and closed sockets are checked, never times."""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import time
from pathlib import Path

import httpx
import pytest

from ember.testing.server import EmberServer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
SLEEPER = str(FIXTURES / "sleeper.yaml")
MB = 2**20

pytestmark = pytest.mark.slow


def _status(sock: socket.socket) -> int:
    """The status code of the response the server sends on `sock` (0 if it closed without one)."""
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return 0
        data += chunk
    return int(data.split(b" ", 2)[1])


def _closed_by_server(sock: socket.socket, timeout: float = 30) -> bool:
    """True once the server has closed `sock` (EOF or reset; anything it sent first is skipped)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _head(length: int) -> bytes:
    return (f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_concurrent_large_bodies_past_the_budget_are_429_and_the_budget_comes_back(tmp_path: Path) -> None:
    body = b'{"model": "nope", "input": "' + b"x" * (6 * MB) + b'"}'
    with EmberServer(tmp_path, "--models", SLEEPER, "--max-body-mb", "8", "--max-inflight-mb", "20") as server:
        socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(6)]
        try:
            for sock in socks:             # six bodies announced at once: the budget holds three of them
                sock.sendall(_head(len(body)))
            time.sleep(0.5)                # (only lets the gateway see every head before any body ends)
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                codes = sorted(pool.map(lambda s: (s.sendall(body), _status(s))[1], socks))
        finally:
            for sock in socks:
                sock.close()
        assert codes == [404, 404, 404, 429, 429, 429]   # 404: admitted, and the model is unknown
        r = httpx.post(server.url + "/v1/embeddings", content=body, timeout=30)
        assert r.status_code == 404                        # every byte was handed back
        one_too_many = b" " * (8 * MB + 1)
        assert httpx.post(server.url + "/v1/embeddings", content=one_too_many, timeout=30).status_code == 413


def test_idle_and_slow_sockets_are_closed_and_never_block_a_request(tmp_path: Path) -> None:
    args = ("--models", SLEEPER, "--header-timeout-s", "1", "--http-keepalive-s", "1",
            "--body-timeout-s", "1", "--max-connections", "260")
    with EmberServer(tmp_path, *args) as server:
        addr = ("127.0.0.1", server.port)
        idle = [socket.create_connection(addr) for _ in range(200)]
        slow = [socket.create_connection(addr) for _ in range(40)]
        for sock in slow:                  # headers begun, never finished
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
        stalled = socket.create_connection(addr)
        stalled.sendall(_head(100) + b'{"model": ')   # a body that stops coming
        try:
            assert httpx.get(server.url + "/v2/health/live", timeout=10).status_code == 200
            over = [socket.create_connection(addr) for _ in range(40)]   # past the cap of 260
            refused = [_status(s) for s in over]
            assert refused.count(503) >= 20 and set(refused) <= {0, 503}
            assert _status(stalled) == 408
            assert all(_closed_by_server(s) for s in idle + slow + over + [stalled])
            kept = socket.create_connection(addr)   # a kept-alive connection, idle after its answer
            kept.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _status(kept) == 200 and _closed_by_server(kept)
            assert httpx.get(server.url + "/v2/health/live", timeout=10).status_code == 200
        finally:
            for sock in idle + slow + [stalled]:
                sock.close()


def test_trickling_bodies_lose_their_hold_on_the_budget_to_the_minimum_rate(tmp_path: Path) -> None:
    """Four sockets declare 6 MB each (the 20 MB budget holds three) and send a byte every 0.5 s, which resets the
    pause timeout forever: under the minimum rate (64 KiB/s after 10 s) each is 408 and closed, and a real
    request is admitted again."""
    body = b'{"model": "nope", "input": "' + b"x" * (6 * MB) + b'"}'
    with EmberServer(tmp_path, "--models", SLEEPER, "--max-body-mb", "8", "--max-inflight-mb", "20") as server:
        socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
        start = time.monotonic()
        codes: list[int] = []
        try:
            for sock in socks:
                sock.sendall(_head(len(body)))
            time.sleep(0.5)
            assert httpx.post(server.url + "/v1/embeddings", content=body, timeout=30).status_code == 429
            for sock in socks:
                sock.setblocking(False)
            while len(codes) < len(socks) and time.monotonic() - start < 25:
                for sock in socks:
                    with contextlib.suppress(OSError):    # (BlockingIOError among them)
                        sock.send(b"x")
                    try:
                        head = sock.recv(4096)
                    except BlockingIOError:
                        continue
                    except OSError:
                        head = b""
                    if head and sock.fileno() >= 0:
                        codes.append(int(head.split(b" ", 2)[1]))
                        sock.close()
                time.sleep(0.5)
            took = time.monotonic() - start
        finally:
            for sock in socks:
                sock.close()
        # Three held the budget: 408 under the rate; the fourth was refused (429), its trickle read and dropped
        # at the same pace.
        assert sorted(codes) == [408, 408, 408, 429], codes
        assert 9 < took < 20, took
        assert httpx.post(server.url + "/v1/embeddings", content=body, timeout=30).status_code == 404
