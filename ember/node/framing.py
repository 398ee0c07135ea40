"""Frames between the node and its processes: a prefix, a small JSON header, then raw tensor bytes.

    u32 header length | u32 payload length | header (JSON, utf-8) | payload

The header says what the frame is (`op`, a request `id`, ...) and, when tensors ride along,
lists them in payload order: `tensors: [{name, datatype, shape, nbytes}]`, the entries of a tensor bundle
(`ember.wire.bundle`, the one codec of tensors as bytes).
The same frames serve the blocking side (forked processes, plain sockets) and the asyncio side
(the node, stream readers/writers).

The node reads its processes' frames under `PayloadLimits`: the most payload bytes each op may carry (a process's
protocol says which of its frames carry tensors at all), checked on the header before a byte of the payload is
read, so a process cannot make the node allocate more than its protocol needs.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ember.errors import InvalidInput
from ember.wire.bundle import describe, read_tensors
from ember.wire.tensors import Tensors

PREFIX = struct.Struct("<II")
MAX_HEADER_BYTES = 1 << 20
MAX_PAYLOAD_BYTES = (1 << 32) - 1   # the u32 field's own limit

Header = dict[str, Any]


@dataclass(frozen=True)
class Frame:
    header: Header
    payload: bytes | bytearray | memoryview = b""

    @property
    def op(self) -> str:
        return str(self.header.get("op", ""))

    def tensors(self) -> Tensors:
        return read_tensors(self.header.get("tensors", []), self.payload, "frame")


@dataclass(frozen=True)
class PayloadLimits:
    """The most payload bytes a frame may carry, by its op; an op not named carries none (headers only)."""

    by_op: Mapping[str, int] = field(default_factory=dict)

    def of(self, header: Header) -> int:
        return self.by_op.get(str(header.get("op", "")), 0)

    def check(self, header: Header, payload_len: int) -> None:
        """InvalidInput when the frame's payload is past its op's limit."""
        limit = self.of(header)
        if payload_len > limit:
            raise InvalidInput(f"frame: a {str(header.get('op', ''))[:40]!r} frame with a payload of {payload_len} "
                               f"bytes, past its limit of {limit}")


HEADERS_ONLY = PayloadLimits()


def payload_size(buffers: list[bytes]) -> int:
    """The payload bytes of a frame `encode_frame` made."""
    return sum(len(b) for b in buffers[2:])


def encode_frame(header: Mapping[str, Any], tensors: Mapping[str, np.ndarray] | None = None) -> list[bytes]:
    """The frame as a list of buffers (prefix, header, one per tensor) for vectored writes."""
    head = dict(header)
    chunks: list[bytes] = []
    if tensors is not None:
        head["tensors"], chunks = describe(tensors)
    encoded = json.dumps(head, separators=(",", ":")).encode()
    payload_len = sum(len(c) for c in chunks)
    if len(encoded) > MAX_HEADER_BYTES:
        raise InvalidInput(f"frame: header of {len(encoded)} bytes exceeds {MAX_HEADER_BYTES}")
    if payload_len > MAX_PAYLOAD_BYTES:
        raise InvalidInput(f"frame: payload of {payload_len} bytes exceeds {MAX_PAYLOAD_BYTES}")
    return [PREFIX.pack(len(encoded), payload_len), encoded, *chunks]


def parse_prefix(prefix: bytes | bytearray) -> tuple[int, int]:
    header_len, payload_len = PREFIX.unpack(prefix)
    if not 0 < header_len <= MAX_HEADER_BYTES:
        raise InvalidInput(f"frame: header length {header_len} outside 1..{MAX_HEADER_BYTES}")
    return header_len, payload_len


def parse_header(raw: bytes | bytearray) -> Header:
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidInput(f"frame: header is not JSON: {err}") from None
    except RecursionError:
        raise InvalidInput("frame: header is nested too deeply") from None
    if not isinstance(header, dict):
        raise InvalidInput(f"frame: header is a {type(header).__name__}, not an object")
    return header


# --- blocking side (forked processes) -------------------------------------------------------


def send_frame(sock: socket.socket, header: Mapping[str, Any],
               tensors: Mapping[str, np.ndarray] | None = None) -> None:
    send_buffers(sock, encode_frame(header, tensors))


def send_buffers(sock: socket.socket, buffers: list[bytes]) -> None:
    """Send an encoded frame with one vectored write where the socket takes it all."""
    sent = sock.sendmsg(buffers)
    total = sum(len(b) for b in buffers)
    if sent < total:  # a short vectored write: send the rest plainly
        sock.sendall(memoryview(b"".join(buffers))[sent:])


def _recv_exactly(sock: socket.socket, n: int) -> bytearray | None:
    """n bytes, or None on EOF before the first byte; EOF mid-way is a truncated frame."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise InvalidInput(f"frame: connection closed after {got} of {n} bytes")
        got += k
    return buf


def recv_frame(sock: socket.socket, limits: PayloadLimits | None = None) -> Frame | None:
    """The next frame, or None when the peer closed the connection between frames. `limits`: InvalidInput for a
    payload past its op's limit, before any of it is read (None: the u32 field's own limit)."""
    prefix = _recv_exactly(sock, PREFIX.size)
    if prefix is None:
        return None
    header_len, payload_len = parse_prefix(prefix)
    if limits is not None:
        raw = _recv_exactly(sock, header_len)
        if raw is None:
            raise InvalidInput("frame: connection closed after the prefix")
        header = parse_header(raw)
        limits.check(header, payload_len)
        payload = _recv_exactly(sock, payload_len) if payload_len else bytearray()
        if payload is None:
            raise InvalidInput("frame: connection closed after the header")
        return Frame(header, memoryview(payload))
    raw = _recv_exactly(sock, header_len + payload_len)
    if raw is None:
        raise InvalidInput("frame: connection closed after the prefix")
    # A bytearray payload makes the decoded tensors writable (numpy views over it).
    return Frame(parse_header(raw[:header_len]), memoryview(raw)[header_len:])


class FrameReader:
    """Frames from a blocking socket without blocking: `pump()` takes what has arrived and returns the
    frames it completed, so a busy instance can look for cancels and new requests between batches.

    A frame's body is read into one buffer of its own size (allocated once its prefix is in), so the
    decoded tensors are writable views and a big request is not copied again.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._prefix = bytearray()
        self._body: bytearray | None = None
        self._header_len = 0
        self._got = 0
        self.eof = False

    def pump(self) -> list[Frame]:
        """Complete frames that arrived (maybe none); sets `eof` when the peer closed between frames."""
        frames: list[Frame] = []
        while not self.eof:
            frame = self._step()
            if frame is None:
                break
            frames.append(frame)
        return frames

    def _step(self) -> Frame | None:
        while self._body is None:
            chunk = self._recv(PREFIX.size - len(self._prefix))
            if chunk is None:
                return None
            self._prefix += chunk
            if len(self._prefix) == PREFIX.size:
                self._header_len, payload_len = parse_prefix(self._prefix)
                self._body, self._got = bytearray(self._header_len + payload_len), 0
        view = memoryview(self._body)
        while self._got < len(view):
            try:
                n = self._sock.recv_into(view[self._got:], len(view) - self._got, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return None
            if n == 0:
                raise InvalidInput(f"frame: connection closed after {self._got} of {len(view)} bytes")
            self._got += n
        body, self._body, self._prefix = self._body, None, bytearray()
        return Frame(parse_header(body[: self._header_len]), memoryview(body)[self._header_len:])

    def _recv(self, n: int) -> bytes | None:
        try:
            chunk = self._sock.recv(n, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        if not chunk:
            if self._prefix:
                raise InvalidInput("frame: connection closed inside the prefix")
            self.eof = True
            return None
        return chunk


# --- asyncio side (the node) ------------------------------------------------------------------


async def read_frame(reader: asyncio.StreamReader, limits: PayloadLimits | None = None) -> Frame | None:
    """The next frame, or None on EOF between frames. `limits`: InvalidInput for a payload past its op's limit,
    known from the header before any of the payload is read (None: the u32 field's own limit)."""
    try:
        prefix = await reader.readexactly(PREFIX.size)
    except asyncio.IncompleteReadError as err:
        if not err.partial:
            return None
        raise InvalidInput("frame: connection closed inside the prefix") from None
    header_len, payload_len = parse_prefix(prefix)
    try:
        header = parse_header(await reader.readexactly(header_len))
        if limits is not None:
            limits.check(header, payload_len)
        payload = await reader.readexactly(payload_len) if payload_len else b""
    except asyncio.IncompleteReadError:
        raise InvalidInput("frame: connection closed inside a frame") from None
    return Frame(header, payload)


def write_frame(writer: asyncio.StreamWriter, header: Mapping[str, Any],
                tensors: Mapping[str, np.ndarray] | None = None) -> None:
    """Queue a frame on the writer (await `writer.drain()` afterwards for back-pressure)."""
    writer.writelines(encode_frame(header, tensors))
