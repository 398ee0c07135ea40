"""The remote tier: a store root served by any static HTTP server (nginx, an object-store gateway).

Chunks are `chunks/<2 hex>/<digest>` and manifests `manifests/<name>/<version>.json` under the base URL.
A chunk up to the part size comes in one request and is hashed as it arrives; a larger one is fetched as
parallel Range requests over keep-alive connections (one per thread). Either way the bytes go through a
small reused buffer and are written at their offset into every destination file.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import os
import select
import socket
import ssl
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from ember.errors import StoreError, TierUnavailable
from ember.store.manifest import Chunk
from ember.store.tiers.body import RECV_BUFFER, BodyCopier, Hasher, chunk_path, copy_chunk

_F_SETPIPE_SZ = 1031


class _NotFound(Exception):
    pass


class HttpTier:
    """Implements `ember.store.tiers.Remote`."""

    def __init__(self, base_url: str, *, timeout_s: float = 30.0, part_size: int = 16 << 20, threads: int = 4,
                 name: str = "origin", headers: Mapping[str, str] | None = None,
                 path_of: Callable[[Chunk], str] = chunk_path, ssl_context: ssl.SSLContext | None = None) -> None:
        """`name`, `headers` and `path_of` let a peer's gateway be read the same way (ember/store/tiers/peer.py):
        another name in errors, its token, its chunk route."""
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise StoreError(f"{name} {base_url!r} is not an http(s) URL")
        self.name = name
        self.base_url = base_url
        self._headers = dict(headers or {})
        self._path_of = path_of
        self._https = url.scheme == "https"
        self._ssl = ssl_context   # None: the system's trust store (a peer's: the cluster CA, mutual TLS)
        self._host = url.hostname
        self._port = url.port or (443 if self._https else 80)
        self._prefix = url.path.rstrip("/") + "/"
        self._timeout = timeout_s
        self._part = part_size
        self._local = threading.local()
        self._body = BodyCopier(f"{name} {base_url}")
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ember-http")
        self._pipes: list[tuple[int, int]] = []
        self._splice_ok = hasattr(os, "splice")

    def fetch(self, path: str) -> bytes | None:
        try:
            return self._get(path, None, None)
        except _NotFound:
            return None

    def copy_to(self, chunk: Chunk, fds: Sequence[int]) -> str | None:
        """One request (hashed as it arrives) for a chunk up to the part size; parallel Range requests above it."""
        path = self._path_of(chunk)
        try:
            # Spliced bytes never reach user space, so the caller hashes the written file instead.
            return copy_chunk(chunk, self._part, self._pool, lambda span, hasher: self._get(path, span, fds, hasher),
                              hash_single=not self._can_splice(fds))
        except _NotFound:
            raise StoreError(f"{self.name} {self.base_url} has no chunk {chunk.digest}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for r, w in self._pipes:
            os.close(r)
            os.close(w)
        self._pipes.clear()

    # -- one request ---------------------------------------------------------------------------------------------
    def _connection(self, fresh: bool = False) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            if self._https:
                conn = http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout, context=self._ssl)
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
            self._local.conn = conn
        return conn

    def _get(self, path: str, span: tuple[int, int] | None, fds: Sequence[int] | None,
             hasher: Hasher | None = None) -> bytes | None:
        """GET `path` (bytes `span` of it) into every fd at the span's offset; or return the body when fds is None."""
        for attempt in (0, 1):
            try:
                return self._request(path, span, fds, hasher, fresh=attempt > 0)
            except (http.client.RemoteDisconnected, http.client.BadStatusLine, BrokenPipeError, ConnectionResetError):
                if attempt:
                    raise TierUnavailable(f"{self.name} {self.base_url} dropped the connection for {path}") from None
            except (OSError, http.client.HTTPException) as err:
                raise TierUnavailable(f"{self.name} {self.base_url} is unreachable: {err}") from None
        raise AssertionError("unreachable")

    def _request(
        self, path: str, span: tuple[int, int] | None, fds: Sequence[int] | None, hasher: Hasher | None, fresh: bool
    ) -> bytes | None:
        conn = self._connection(fresh)
        headers = dict(self._headers)
        if span is not None:
            headers["Range"] = f"bytes={span[0]}-{span[1] - 1}"
        conn.request("GET", self._prefix + path, headers=headers)
        resp = conn.getresponse()
        if resp.status == 404:
            resp.read()
            raise _NotFound(path)
        if resp.status not in (200, 206):
            resp.read()
            raise TierUnavailable(f"{self.name} {self.base_url} answered {resp.status} for {path}")
        if fds is None or span is None:
            return resp.read()
        if span[0] > 0 and resp.status != 206:
            resp.read()
            raise TierUnavailable(f"{self.name} {self.base_url} ignores Range requests")
        if hasher is None and self._can_splice(fds) and resp.length == span[1] - span[0] and conn.sock is not None:
            self._splice(conn.sock, resp, span, fds[0])
        else:
            self._receive(resp, span, fds, hasher)
        return None

    def _can_splice(self, fds: Sequence[int]) -> bool:
        return self._splice_ok and not self._https and len(fds) == 1

    def _pipe(self) -> tuple[int, int]:
        pipe: tuple[int, int] | None = getattr(self._local, "pipe", None)
        if pipe is None:
            pipe = self._local.pipe = os.pipe()
            with contextlib.suppress(OSError):
                fcntl.fcntl(pipe[1], _F_SETPIPE_SZ, RECV_BUFFER)
            self._pipes.append(pipe)
        return pipe

    def _splice(self, sock: socket.socket, resp: http.client.HTTPResponse, span: tuple[int, int], fd: int) -> None:
        """Move the body from the socket into the file through a pipe, inside the kernel (one copy, not two)."""
        offset, end = span
        assert resp.fp is not None
        head = resp.fp.peek(1)[: end - offset]  # body bytes already read along with the headers
        if head:
            head = resp.fp.read(len(head))
            self._body.write([fd], head, offset)
            offset += len(head)
        r, w = self._pipe()
        try:
            while offset < end:
                n = self._splice_in(sock, w, end - offset)
                done = 0
                while done < n:
                    done += os.splice(r, fd, n - done, offset_dst=offset + done)
                offset += n
        except OSError as err:
            if isinstance(err, TimeoutError):
                raise
            raise StoreError(f"cannot write a chunk fetched from {self.base_url}: {err.strerror}") from None
        resp.length = 0
        resp.close()  # the body is consumed: the connection can carry the next request

    def _splice_in(self, sock: socket.socket, pipe_w: int, left: int) -> int:
        while True:
            try:
                n = os.splice(sock.fileno(), pipe_w, min(left, RECV_BUFFER))
            except BlockingIOError:  # a socket with a timeout is non-blocking underneath
                if not select.select([sock], [], [], self._timeout)[0]:
                    raise TimeoutError(f"no data from {self.base_url} for {self._timeout} s") from None
                continue
            if n == 0:
                raise TierUnavailable(f"{self.name} {self.base_url}: body ended {left} bytes early")
            return n

    def _receive(self, resp: http.client.HTTPResponse, span: tuple[int, int], fds: Sequence[int],
                 hasher: Hasher | None) -> None:
        self._body.copy(resp, "body", span, fds, hasher)
        if resp.read(1):
            raise TierUnavailable(f"{self.name} {self.base_url}: body longer than {span[1] - span[0]} bytes")
