"""`GET /v2/store/chunks/{digest}`: a node serves the weight-store chunks it holds to its peers (read only), and
`GET /v2/store/manifests/{name}/{version}.json` the manifests of its store (a process image's is found by name).

The peer tier (ember/store/tiers/peer.py) reads it as it reads the HTTP origin: whole chunks or one Range part.
The chunk file (memory tier first, then disk) is opened by the route itself, so a chunk evicted since the
lookup is a 404 (an open file stays readable when the store unlinks it), then streamed in 8 MiB `pread`s,
one worker-thread hop each (a cold disk read never stalls the event loop; Starlette's `FileResponse` paid a
hop per 64 KiB read plus its open, stat and close). Access: admin keys or the cluster token (`Access.PEER`,
ember/gateway/auth.py).
"""

from __future__ import annotations

import os
import re
from typing import Protocol

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ember.errors import ChunkNotFound, InvalidInput, ModelNotFound
from ember.gateway.context import gateway_of
from ember.store.shared import DIGEST, ChunkFile
from ember.wire.refs import ModelRef

READ_BYTES = 8 << 20
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


class ChunkFiles(Protocol):
    def find(self, digest: str) -> ChunkFile | None:
        """The file of a chunk this node holds, or None."""
        ...

    def manifest(self, ref: ModelRef) -> bytes | None:
        """The manifest of a model this node's store holds, or None."""
        ...


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """[start, end) of a single `Range: bytes=a-b` (also `a-` and `-n`); None: the whole file (no header, or one
    this route does not do, e.g. several ranges: a server may ignore Range); (size, size): unsatisfiable."""
    m = _RANGE.fullmatch(header.strip()) if header else None
    if m is None or m.group(1) == m.group(2) == "":
        return None
    if m.group(1) == "":
        return max(0, size - int(m.group(2))), size
    start = int(m.group(1))
    end = size if m.group(2) == "" else min(size, int(m.group(2)) + 1)
    return (start, end) if start < end else (size, size)


class ChunkStream(Response):
    """An open chunk file, whole (200) or one range of it (206); the response closes the file."""

    def __init__(self, fd: int, size: int, span: tuple[int, int] | None) -> None:
        self.fd, (self.start, self.end) = fd, span or (0, size)
        headers = {"content-length": str(self.end - self.start), "accept-ranges": "bytes",
                   "cache-control": "no-store"}
        if span is not None:
            headers["content-range"] = f"bytes {self.start}-{self.end - 1}/{size}"
        super().__init__(None, 206 if span is not None else 200, headers, "application/octet-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            at = self.start
            if scope.get("method") == "HEAD":
                at = self.end
            while at < self.end:
                data = await anyio.to_thread.run_sync(os.pread, self.fd, min(READ_BYTES, self.end - at), at)
                if not data:   # the file is shorter than it said: cut the response off, the peer tries the next
                    raise OSError(f"chunk file ended at byte {at} of {self.end}")
                at += len(data)
                await send({"type": "http.response.body", "body": data, "more_body": at < self.end})
            if self.start == self.end or scope.get("method") == "HEAD":
                await send({"type": "http.response.body", "body": b""})
        finally:
            os.close(self.fd)


async def chunk(request: Request) -> Response:
    digest = request.path_params["digest"]
    if not DIGEST.fullmatch(digest):
        raise InvalidInput(f"digest: must be 64 lowercase hex characters (a blake3 chunk digest), got "
                           f"{digest[:80]!r}")
    files = gateway_of(request).chunks
    found = files.find(digest) if files is not None else None
    try:
        fd = os.open(found.path, os.O_RDONLY | os.O_CLOEXEC) if found is not None else None
    except FileNotFoundError:   # evicted since the lookup
        fd = None
    if fd is None:
        raise ChunkNotFound(f"chunk {digest}: not held by this node")
    size = os.fstat(fd).st_size
    span = byte_range(request.headers.get("range"), size)
    if span == (size, size):
        os.close(fd)
        return Response(status_code=416, headers={"content-range": f"bytes */{size}"})
    return ChunkStream(fd, size, span)


async def manifest(request: Request) -> Response:
    name, version = request.path_params["name"], request.path_params["version"]
    ref = ModelRef.parse(f"{name}:{version.removesuffix('.json')}")   # InvalidInput names the part
    files = gateway_of(request).chunks
    data = files.manifest(ref) if files is not None else None
    if data is None:
        raise ModelNotFound(f"weight store: no manifest of {ref.key} on this node")
    return Response(data, 200, {"cache-control": "no-store"}, "application/json")
