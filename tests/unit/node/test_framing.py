"""Frames round-trip tensors as raw bytes, on blocking sockets and on asyncio streams."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import struct
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.errors import InvalidInput
from ember.node.framing import (
    HEADERS_ONLY,
    PREFIX,
    Frame,
    FrameReader,
    PayloadLimits,
    encode_frame,
    read_frame,
    recv_frame,
    send_frame,
    write_frame,
)
from ember.node.instance import payload_limits
from ember.wire.contract import parse_contract


def sample() -> dict[str, np.ndarray]:
    text = np.empty(2, dtype=object)
    text[:] = [b"hello", "wörld".encode()]
    return {
        "x": np.arange(12, dtype=np.float32).reshape(3, 4),
        "ids": np.array([[1, -2], [3, 4]], dtype=np.int64),
        "mask": np.array([True, False]),
        "text": text,
        "empty": np.zeros((0, 3), dtype=np.float16),
    }


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].shape == b[name].shape, name
        assert a[name].dtype == b[name].dtype, name
        assert (a[name] == b[name]).all(), name


def test_blocking_round_trip_keeps_header_order_and_tensors() -> None:
    left, right = socket.socketpair()
    with left, right:
        send_frame(left, {"op": "infer", "id": 7}, sample())
        send_frame(left, {"op": "ping", "id": 8})
        first, second = recv_frame(right), recv_frame(right)
    assert first is not None and second is not None
    assert first.op == "infer" and first.header["id"] == 7
    assert [t["name"] for t in first.header["tensors"]] == list(sample())
    got = first.tensors()
    assert_same(got, sample())
    assert got["x"].flags.writeable  # received into a bytearray: models may write in place
    assert second.op == "ping" and second.tensors() == {}


def test_tensors_travel_as_raw_bytes_not_json() -> None:
    x = np.arange(1000, dtype=np.float32)
    buffers = encode_frame({"op": "infer"}, {"x": x})
    header_len, payload_len = PREFIX.unpack(buffers[0])
    header = json.loads(buffers[1])
    assert header_len == len(buffers[1])
    assert payload_len == x.nbytes == header["tensors"][0]["nbytes"]
    assert buffers[2] == x.tobytes()


def test_eof_between_frames_is_none_and_inside_a_frame_is_an_error() -> None:
    left, right = socket.socketpair()
    with right:
        left.close()
        assert recv_frame(right) is None
    left, right = socket.socketpair()
    with right:
        whole = b"".join(encode_frame({"op": "infer"}, {"x": np.ones(4, dtype=np.float32)}))
        left.sendall(whole[:-3])
        left.close()
        with pytest.raises(InvalidInput, match="closed after"):
            recv_frame(right)


def test_bad_prefix_and_header_are_errors() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(struct.pack("<II", 0, 0))
        with pytest.raises(InvalidInput, match="header length"):
            recv_frame(right)
    left, right = socket.socketpair()
    with left, right:
        left.sendall(struct.pack("<II", 3, 0) + b"[1]")
        with pytest.raises(InvalidInput, match="not an object"):
            recv_frame(right)
    left, right = socket.socketpair()
    with left, right:
        left.sendall(struct.pack("<II", 3, 0) + b"{no")
        with pytest.raises(InvalidInput, match="not JSON"):
            recv_frame(right)


def test_asyncio_round_trip_both_ways() -> None:
    async def main() -> None:
        left, right = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=left)
        try:
            write_frame(writer, {"op": "infer", "id": 1}, sample())
            await writer.drain()
            frame = await asyncio.to_thread(recv_frame, right)
            assert frame is not None
            assert_same(frame.tensors(), sample())
            await asyncio.to_thread(send_frame, right, {"op": "result", "id": 1}, {"y": np.eye(3)})
            back = await read_frame(reader)
            assert back is not None and back.header["id"] == 1
            assert (back.tensors()["y"] == np.eye(3)).all()
            right.close()
            assert await read_frame(reader) is None
        finally:
            writer.close()

    asyncio.run(main())


# --- FrameReader: non-blocking reads from a blocking socket --------------------------------------


def frame_bytes(header: dict, tensors: dict[str, np.ndarray] | None = None) -> bytes:
    return b"".join(encode_frame(header, tensors))


def test_frame_reader_returns_nothing_at_once_when_nothing_arrived() -> None:
    left, right = socket.socketpair()
    with left, right:
        assert right.getblocking()
        reader = FrameReader(right)
        assert reader.pump() == []
        assert reader.pump() == []
        assert not reader.eof


def test_frame_reader_puts_together_frames_written_a_few_bytes_at_a_time() -> None:
    first = frame_bytes({"op": "infer", "id": 1}, sample())
    second = frame_bytes({"op": "ping", "id": 2})
    stream = first + second
    left, right = socket.socketpair()
    with left, right:
        reader = FrameReader(right)
        got: list[tuple[int, Frame]] = []   # (bytes written when it completed, frame)
        sizes = [1, 2, 3, 5, 7, 11]           # cuts that fall inside prefixes, headers and tensors
        pos = i = 0
        while pos < len(stream):
            step = sizes[i % len(sizes)]
            left.sendall(stream[pos:pos + step])
            pos, i = min(len(stream), pos + step), i + 1
            got.extend((pos, frame) for frame in reader.pump())
        assert not reader.eof
    assert [(at, frame.op) for at, frame in got] == [(len(first), "infer"), (len(stream), "ping")]
    assert got[0][1].header["id"] == 1 and got[1][1].header["id"] == 2
    assert_same(got[0][1].tensors(), sample())
    assert got[1][1].tensors() == {}


def test_frame_reader_returns_every_frame_of_one_write_in_order() -> None:
    frames = [frame_bytes({"op": "infer", "id": i}, {"x": np.full(i + 1, i, dtype=np.int32)}) for i in range(3)]
    frames.append(frame_bytes({"op": "cancel", "id": 0}))
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"".join(frames))
        reader = FrameReader(right)
        got = reader.pump()
        assert reader.pump() == []
    assert [(f.op, f.header["id"]) for f in got] == [("infer", 0), ("infer", 1), ("infer", 2), ("cancel", 0)]
    for i, frame in enumerate(got[:3]):
        assert frame.tensors()["x"].tolist() == [i] * (i + 1)


def test_frame_reader_takes_a_payload_bigger_than_the_socket_buffer() -> None:
    big = np.random.default_rng(0).standard_normal((1 << 22,)).astype(np.float32)   # 16 MiB
    left, right = socket.socketpair()
    with left, right:
        writer = threading.Thread(target=send_frame, args=(left, {"op": "infer", "id": 9}, {"x": big}))
        writer.start()
        reader = FrameReader(right)
        got: list[Frame] = []
        pumps = 0
        while not got:
            readable, _, _ = select.select([right], [], [], 10)
            assert readable, "the writer stalled"
            got = reader.pump()
            pumps += 1
        writer.join(10)
        assert not writer.is_alive()
        assert reader.pump() == []
    assert pumps > 1     # it did come in pieces, and pump() returned between them
    assert len(got) == 1 and got[0].header["id"] == 9
    x = got[0].tensors()["x"]
    assert np.array_equal(x, big)
    assert x.flags.writeable


def test_frame_reader_sets_eof_when_the_peer_closes_between_frames() -> None:
    left, right = socket.socketpair()
    with right:
        left.sendall(frame_bytes({"op": "ping", "id": 1}))
        left.close()
        reader = FrameReader(right)
        got = reader.pump()
        assert [f.op for f in got] == ["ping"]
        assert reader.eof
        assert reader.pump() == []
    left, right = socket.socketpair()
    with right:
        left.close()
        reader = FrameReader(right)
        assert reader.pump() == [] and reader.eof


@pytest.mark.parametrize("keep", [3, PREFIX.size + 2, -1], ids=["inside-prefix", "inside-header", "inside-payload"])
def test_frame_reader_raises_when_the_peer_closes_inside_a_frame(keep: int) -> None:
    whole = frame_bytes({"op": "infer", "id": 1}, {"x": np.ones(4, dtype=np.float32)})
    left, right = socket.socketpair()
    with right:
        left.sendall(whole[:keep])
        reader = FrameReader(right)
        assert reader.pump() == []     # a partial frame is no frame yet, and no error either
        left.close()
        with pytest.raises(InvalidInput, match="closed"):
            reader.pump()
        assert not reader.eof


def test_frame_reader_rejects_a_bad_prefix() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(struct.pack("<II", 0, 0))
        with pytest.raises(InvalidInput, match="header length"):
            FrameReader(right).pump()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(1, 64))
def test_a_frame_reader_fed_any_bytes_yields_frames_or_a_named_frame_error(data: bytes, step: int) -> None:
    a, b = socket.socketpair()
    try:
        reader = FrameReader(b)
        try:
            for i in range(0, len(data), step):
                a.sendall(data[i:i + step])
                for frame in reader.pump():
                    assert isinstance(frame.header, dict)
            a.close()
            reader.pump()
        except InvalidInput as err:
            assert str(err).startswith("frame:")
    finally:
        a.close()
        b.close()


# --- PayloadLimits: what a process's frames may carry, checked before the payload is read ---------------------------


def read_limited(data: bytes, limits: PayloadLimits) -> tuple[Frame | None, int]:
    """The frame `read_frame` reads from `data` under `limits`, and the bytes it left unread."""
    async def main() -> tuple[Frame | None, int]:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        frame = await read_frame(reader, limits)
        return frame, len(await reader.read())
    return asyncio.run(main())


def test_a_payload_past_its_ops_limit_is_refused_on_the_header_before_it_is_read() -> None:
    limits = PayloadLimits({"result": 16})
    reply = frame_bytes({"op": "result", "id": 1}, {"y": np.zeros(4, np.float32)})   # 16 bytes: at the limit
    frame, left = read_limited(reply, limits)
    assert frame is not None and frame.tensors()["y"].tolist() == [0.0] * 4 and left == 0
    big = frame_bytes({"op": "result", "id": 1}, {"y": np.zeros(5, np.float32)})
    header_len = PREFIX.unpack(big[:PREFIX.size])[0]
    with pytest.raises(InvalidInput, match="'result' frame with a payload of 20 bytes, past its limit of 16"):
        read_limited(big, limits)
    # An announced payload that never comes: refused all the same, on the header alone.
    head = big[:PREFIX.size + header_len]
    with pytest.raises(InvalidInput, match="past its limit"):
        read_limited(struct.pack("<II", header_len, (1 << 32) - 1) + head[PREFIX.size:], limits)
    pong = b'{"op":"pong","id":1}'
    with pytest.raises(InvalidInput, match="'pong' frame with a payload of 1 bytes, past its limit of 0"):
        read_limited(struct.pack("<II", len(pong), 1) + pong + b"x", HEADERS_ONLY)


def test_a_header_nested_too_deeply_is_a_frame_error() -> None:
    deep = b"[" * 100_000
    with pytest.raises(InvalidInput, match="nested too deeply"):
        read_limited(struct.pack("<II", len(deep), 0) + deep, HEADERS_ONLY)


def test_an_instances_limits_are_its_memory_and_the_servers_reply_limit() -> None:
    contract = parse_contract({"name": "m", "runtime": "python", "entrypoint": "m:M",
                               "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
                               "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
                               "resources": {"memory_mb": 64}})
    alone, budgeted = payload_limits(contract), payload_limits(contract, 1000)
    assert alone.of({"op": "result"}) == alone.of({"op": "drained"}) == 64 << 20
    assert budgeted.of({"op": "result"}) == 1000 and budgeted.of({"op": "drained"}) == 64 << 20
    assert payload_limits(contract, 1 << 40).of({"op": "result"}) == 64 << 20
    assert all(budgeted.of({"op": op}) == 0 for op in ("hello", "pong", "error", "end", "cancelled", "slept", "x"))


def test_the_blocking_reader_refuses_a_payload_past_its_limit_before_reading_it() -> None:
    pong = b'{"op":"hello","ok":true}'
    left, right = socket.socketpair()
    with left, right:
        right.settimeout(5)   # a reader waiting for the announced payload fails here instead of hanging
        left.sendall(struct.pack("<II", len(pong), 1 << 30) + pong)   # 1 GiB announced, none of it sent
        with pytest.raises(InvalidInput, match="'hello' frame with a payload of 1073741824 bytes, past its limit of 0"):
            recv_frame(right, HEADERS_ONLY)
        send_frame(left, {"op": "result", "id": 1}, {"y": np.zeros(4, np.float32)})
        frame = recv_frame(right, PayloadLimits({"result": 16}))
        assert frame is not None and frame.tensors()["y"].tolist() == [0.0] * 4
