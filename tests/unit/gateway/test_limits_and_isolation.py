"""Body limits (declared and streamed), and bad requests that never disturb good ones."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from starlette.testclient import TestClient

from ember.errors import Overloaded
from ember.gateway import limits
from ember.gateway.app import create_app
from ember.gateway.limits import BodyPace, parsed_estimate
from ember.jobs.store import JobStore
from ember.metrics import Metrics
from ember.testing.service import FakeService

MAX_BODY = 256 * 1024  # the same limit as the `client` fixture's (tests/unit/gateway/conftest.py)


def test_declared_oversize_is_413_naming_the_limit(client: TestClient) -> None:
    big = b" " * (MAX_BODY + 1)
    r = client.post("/v2/models/affine/infer", content=big)
    assert r.status_code == 413 and str(MAX_BODY) in r.json()["error"]
    r = client.post("/v1/embeddings", content=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"


async def _chunks(total: int, size: int = 64 * 1024) -> AsyncIterator[bytes]:
    sent = 0
    while sent < total:
        n = min(size, total - sent)
        sent += n
        yield b" " * n


def _app(tmp_path: Path, service: FakeService | None = None) -> tuple[httpx.AsyncClient, FakeService, Metrics]:
    service = service or FakeService(jobs=JobStore(tmp_path / "j.sqlite3", max_queued=10, result_ttl_s=60))
    metrics = Metrics()
    app = create_app(service, metrics, max_body_bytes=MAX_BODY)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ember"), service, metrics


def test_streamed_oversize_without_content_length_is_413(tmp_path: Path) -> None:
    async def go() -> httpx.Response:
        client, _, _ = _app(tmp_path)
        async with client:
            return await client.post("/v2/models/affine/infer", content=_chunks(MAX_BODY * 2))

    r = asyncio.run(go())
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]


def test_lying_content_length_is_caught_while_streaming(tmp_path: Path) -> None:
    async def go() -> httpx.Response:
        client, _, _ = _app(tmp_path)
        async with client:
            return await client.post("/v2/models/affine/infer", content=_chunks(MAX_BODY * 2),
                                     headers={"Content-Length": "10"})

    assert asyncio.run(go()).status_code == 413


def test_bad_requests_do_not_disturb_concurrent_good_ones(tmp_path: Path) -> None:
    good_x = np.arange(30, dtype=np.float32).reshape(10, 3)
    good = json.dumps({"inputs": [{"name": "x", "shape": [10, 3], "datatype": "FP32",
                                   "data": good_x.ravel().tolist()}]})
    bads = [
        ("/v2/models/affine/infer", b"{malformed", 400),
        ("/v2/models/nope/infer", good.encode(), 404),
        ("/v2/models/affine/infer", good.replace('"FP32"', '"INT32"').encode(), 400),
        ("/v2/models/affine/infer", good.replace("[10, 3]", "[3, 10]").encode(), 400),
        ("/v2/models/affine/infer", b" " * (MAX_BODY + 1), 413),
        ("/v1/embeddings", b'{"input": [{"text": 1}], "model": "embedder"}', 400),
    ]

    async def go() -> tuple[list[httpx.Response], list[httpx.Response], Metrics]:
        client, service, metrics = _app(tmp_path)
        service.delay_s = 0.02  # good requests are in flight while the bad ones are answered
        async with client:
            goods = [client.post("/v2/models/affine/infer", content=good) for _ in range(20)]
            bad = [client.post(url, content=body) for url, body, _ in bads * 3]
            results = await asyncio.gather(*goods, *bad)
        return list(results[:20]), list(results[20:]), metrics

    goods, bad, metrics = asyncio.run(go())
    for r in goods:
        assert r.status_code == 200
        y = next(o for o in r.json()["outputs"] if o["name"] == "y")
        assert np.allclose(y["data"], (good_x * 2 + 1).ravel())
    assert [r.status_code for r in bad] == [code for _, _, code in bads] * 3
    text = metrics.text().decode()
    assert 'ember_requests_total{api="v2",code="200",model="affine",version="1"} 20.0' in text
    # Unknown names never become labels.
    assert 'ember_requests_total{api="v2",code="404",model="",version=""} 3.0' in text


def test_retry_after_is_whole_seconds_at_least_one(client: TestClient, service: FakeService) -> None:
    for retry_after, header in ((0.0, "1"), (0.01, "1"), (1.0, "1"), (1.2, "2"), (30.0, "30")):
        service.failure = Overloaded("busy", retry_after=retry_after)
        r = client.post("/v2/models/affine/infer",
                        json={"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]})
        assert r.status_code == 429 and r.headers["retry-after"] == header


def test_max_body_bytes_must_be_positive(service: FakeService) -> None:
    with pytest.raises(ValueError, match="max_body_bytes"):
        create_app(service, Metrics(), max_body_bytes=0)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_bodies_are_inflated_within_the_limit(client: TestClient, encoding: str) -> None:
    import gzip
    import zlib

    pack = gzip.compress if encoding == "gzip" else zlib.compress
    x = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
    headers = {"Content-Encoding": encoding}
    r = client.post("/v2/models/affine/infer", content=pack(json.dumps(x).encode()), headers=headers)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [3, 5, 7]
    bomb = pack(b" " * (MAX_BODY * 4))  # a few KiB on the wire
    assert len(bomb) < MAX_BODY
    r = client.post("/v2/models/affine/infer", content=bomb, headers=headers)
    assert r.status_code == 413 and "inflated request body" in r.json()["error"]
    r = client.post("/v2/models/affine/infer", content=pack(b"{}")[:-6], headers=headers)
    assert r.status_code == 400 and f"Content-Encoding {encoding}" in r.json()["error"]
    r = client.post("/v2/models/affine/infer", content=b"{}", headers={"Content-Encoding": "br"})
    assert r.status_code == 400 and "'br' is not supported" in r.json()["error"]


def _budget_app(tmp_path: Path, inflight: int, timeout_s: float = 30.0) -> tuple[httpx.AsyncClient, FakeService]:
    service = FakeService(jobs=JobStore(tmp_path / "j.sqlite3", max_queued=10, result_ttl_s=60))
    app = create_app(service, Metrics(), max_body_bytes=min(MAX_BODY, inflight), max_inflight_bytes=inflight,
                     body_timeout_s=timeout_s)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ember"), service


def _affine_body(rows: int) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "shape": [rows, 3], "datatype": "FP32",
                                   "data": [0.5] * (rows * 3)}]}).encode()


def test_bodies_past_the_gateways_budget_are_429_with_retry_after_and_the_budget_comes_back(tmp_path: Path) -> None:
    body = _affine_body(2000)   # ~30 kB, and its parse; the budget holds two at once
    cost = len(body) + parsed_estimate(body)
    budget = cost * 5 // 2

    async def go() -> tuple[list[httpx.Response], list[httpx.Response]]:
        client, service = _budget_app(tmp_path, budget)
        service.delay_s = 0.1    # every admitted body is held while its request runs
        async with client:
            first = await asyncio.gather(*(client.post("/v2/models/affine/infer", content=body) for _ in range(6)))
            later = await asyncio.gather(*(client.post("/v2/models/affine/infer", content=body) for _ in range(2)))
        return list(first), list(later)

    first, later = asyncio.run(go())
    codes = sorted(r.status_code for r in first)
    assert codes == [200, 200, 429, 429, 429, 429]
    refused = next(r for r in first if r.status_code == 429)
    assert refused.headers["retry-after"] == "1" and "max_inflight_mb" in refused.json()["error"]
    assert [r.status_code for r in later] == [200, 200]   # answered requests handed their bytes back


def test_a_streamed_body_is_counted_as_it_arrives(tmp_path: Path) -> None:
    async def go() -> httpx.Response:
        client, _ = _budget_app(tmp_path, MAX_BODY)
        async with client:
            blocker = client.post("/v2/models/affine/infer", content=_chunks(MAX_BODY // 2),
                                  headers={"Content-Length": str(MAX_BODY // 2)})
            return (await asyncio.gather(blocker, client.post("/v2/models/affine/infer",
                                                              content=_chunks(MAX_BODY // 2 + 100))))[1]

    assert asyncio.run(go()).status_code in (400, 429)   # 400: the first was answered (not JSON) before it came


def test_a_stalled_body_is_408_naming_the_timeout(tmp_path: Path) -> None:
    async def stalls() -> AsyncIterator[bytes]:
        yield b'{"inputs": '
        await asyncio.sleep(5)
        yield b"[]}"

    async def go() -> httpx.Response:
        client, _ = _budget_app(tmp_path, MAX_BODY, timeout_s=0.2)
        async with client:
            return await client.post("/v1/embeddings", content=stalls())

    r = asyncio.run(go())
    assert r.status_code == 408 and r.headers["connection"] == "close"
    assert r.json()["error"]["message"].startswith("request body: no data for 0.2 s (body_timeout_s)")


def test_the_budget_must_hold_one_whole_body(service: FakeService) -> None:
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        create_app(service, Metrics(), max_body_bytes=10, max_inflight_bytes=9)


def test_the_body_pace_names_the_bound_that_ends_the_wait() -> None:
    pace = BodyPace(timeout_s=30, min_rate=1000, deadline_s=120, grace_s=10)
    assert pace.wait(0, 0) == (10, pace.wait(0, 0)[1]) and "minimum rate" in pace.wait(0, 0)[1]
    assert pace.wait(5, 100_000)[0] == 30 and "no data for 30 s" in pace.wait(5, 100_000)[1]
    assert pace.wait(110, 10**9)[0] == 10 and "body_deadline_s" in pace.wait(110, 10**9)[1]
    assert pace.wait(20, 5_000)[0] < 0                          # under the line: refused at once
    assert BodyPace(timeout_s=30, min_rate=0).wait(0, 0)[0] == 30   # no minimum rate


def test_a_body_of_known_size_may_take_the_grace_and_its_bytes_at_the_least_rate_up_to_the_deadline() -> None:
    """A gateway link's frame (ember.gateway.link_server) is armed once by this: the same pace as an HTTP body's."""
    pace = BodyPace(timeout_s=30, min_rate=1000, deadline_s=120, grace_s=10)
    assert pace.whole_s(5_000) == 15                            # 10 s of grace, then 5 s at 1000 bytes/s
    assert pace.whole_s(10**9) == 120                           # the deadline bounds it
    assert BodyPace(min_rate=0, deadline_s=120).whole_s(10**9) == 120   # no minimum rate: the deadline alone


def test_a_trickling_body_is_408_under_the_minimum_rate_and_hands_its_budget_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte every 50 ms would reset the pause timeout forever; the minimum rate ends it."""
    monkeypatch.setattr(limits, "BODY_RATE_GRACE_S", 0.3)

    async def trickle() -> AsyncIterator[bytes]:
        for _ in range(400):
            yield b" "
            await asyncio.sleep(0.05)

    async def go() -> tuple[httpx.Response, float, httpx.Response]:
        service = FakeService(jobs=JobStore(tmp_path / "j.sqlite3", max_queued=10, result_ttl_s=60))
        app = create_app(service, Metrics(), max_body_bytes=MAX_BODY, max_inflight_bytes=MAX_BODY,
                         body_timeout_s=30, body_min_rate=1000)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ember") as client:
            start = time.monotonic()
            slow = await client.post("/v1/embeddings", content=trickle(), headers={"Content-Length": str(MAX_BODY)})
            took = time.monotonic() - start
            after = await client.post("/v2/models/affine/infer", content=_affine_body(10))
        return slow, took, after

    slow, took, after = asyncio.run(go())
    assert slow.status_code == 408 and slow.headers["connection"] == "close"
    message = slow.json()["error"]["message"]
    assert "under the minimum rate of 1000 bytes/s (body_min_rate_kbs)" in message, message
    assert took < 3, took
    assert after.status_code == 200     # the declared length it held came back


def test_a_body_not_whole_by_the_deadline_is_408(tmp_path: Path) -> None:
    async def steady() -> AsyncIterator[bytes]:
        for _ in range(100):
            yield b" " * 10_000
            await asyncio.sleep(0.02)

    async def go() -> httpx.Response:
        service = FakeService(jobs=JobStore(tmp_path / "j.sqlite3", max_queued=10, result_ttl_s=60))
        app = create_app(service, Metrics(), max_body_bytes=MAX_BODY, max_inflight_bytes=MAX_BODY,
                         body_deadline_s=0.5)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ember") as client:
            return await client.post("/v1/embeddings", content=steady())

    r = asyncio.run(go())
    assert r.status_code == 408 and "not complete within 0.5 s (body_deadline_s)" in r.json()["error"]["message"]


@pytest.mark.parametrize("shape", [b"[]", b"{}", b"0", b'"a":1'])
def test_a_body_is_charged_for_what_parsing_makes_of_it(tmp_path: Path, shape: bytes) -> None:
    """`[[],[],...]` is 3 bytes per list on the wire and ~70 in memory: a body's parse is claimed from the budget
    with its bytes, so any JSON shape stays within the budget (413 when one body's parse could never fit)."""
    items = b",".join([shape] * 30_000)
    wrapped = b"{" + items + b"}" if shape.startswith(b'"') else b"[" + items + b"]"
    body = b'{"model": "embedder", "input": ' + wrapped + b"}"
    assert len(body) + parsed_estimate(body) > 5 * len(body)

    async def go() -> httpx.Response:
        client, _ = _budget_app(tmp_path, 4 * len(body))   # the bytes fit; their parse does not
        async with client:
            return await client.post("/v1/embeddings", content=body)

    r = asyncio.run(go())
    assert r.status_code == 413 and "parsing it would take about" in r.json()["error"]["message"]
    # A body of ordinary text costs what it weighs (its string's copy is left out of the claim).
    text = b'{"model": "embedder", "input": "' + b"x" * 100_000 + b'"}'
    assert parsed_estimate(text) < 0.01 * len(text)


@pytest.mark.parametrize(("wide", "width"), [("😀", 4), ("\\ud83d\\ude00", 4), ("ā", 2), ("\\u0101", 2), ("é", 1)],
                         ids=["emoji", "escaped-pair", "latin-ext", "escaped-latin-ext", "latin-1"])
def test_a_strings_widest_character_is_claimed_for_every_character(tmp_path: Path, wide: str, width: int) -> None:
    """A str holds every character in the width of its widest: one emoji makes 100,000 letters take 400 KB, in the
    document's decoded copy while it is parsed and in the string after. The claim says so, so that a body's parse is
    bounded by its claim whatever its characters."""
    text = b'{"model": "embedder", "input": "' + b"x" * 100_000 + wide.encode() + b'"}'
    wider = 2 * (width - 1) * len(text)
    assert wider <= parsed_estimate(text) < wider + 0.01 * len(text)

    async def go() -> httpx.Response:
        client, _ = _budget_app(tmp_path, 3 * len(text))   # the bytes fit, and a 2-byte wide parse beside them
        async with client:
            return await client.post("/v1/embeddings", content=text)

    r = asyncio.run(go())
    assert r.status_code == (413 if width == 4 else 200), r.text
