"""The link between gateways: an HTTP exchange carried as two length-prefixed frames, without an HTTP parser.

A connection to a gateway's port that opens with `PREFACE` is a link (`ember.gateway.link_server`); any other is
HTTP. On a link the forwarding gateway (`ember.cluster.link_client`) writes one request at a time:

    request:  u32 meta length, u32 body length, meta (JSON: {"method", "path", "headers": [[name, value], ...]}),
              body
    response: u32 status, u32 meta length, u32 body length, meta (JSON: {"headers": [[name, value], ...]}), body

Big-endian lengths. The receiving gateway runs the request through its own routes, admission and metrics, as
it does an HTTP request; what a link saves is the HTTP client and server in Python on both sides (bench/cluster.py,
docs/cluster.md). A malformed frame is an InvalidInput naming what is wrong; the server then drops the link.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass

from ember.errors import InvalidInput

PREFACE = b"EMBER-LINK/1\r\n"   # no HTTP method begins with it: a gateway tells a link from HTTP by it
REQUEST_HEAD = struct.Struct("!II")
RESPONSE_HEAD = struct.Struct("!III")
MAX_META = 64 << 10
MAX_HEADERS = 100
METHODS = ("GET", "POST")

Headers = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class LinkRequest:
    method: str
    path: str        # with its query string, if any
    headers: Headers
    body: bytes

    def encode(self) -> bytes:
        meta = json.dumps({"method": self.method, "path": self.path, "headers": [list(h) for h in self.headers]},
                          separators=(",", ":")).encode()
        return REQUEST_HEAD.pack(len(meta), len(self.body)) + meta + self.body


@dataclass(frozen=True)
class LinkResponse:
    status: int
    headers: Headers
    body: bytes

    def encode(self) -> bytes:
        meta = json.dumps({"headers": [list(h) for h in self.headers]}, separators=(",", ":")).encode()
        return RESPONSE_HEAD.pack(self.status, len(meta), len(self.body)) + meta + self.body

    def header(self, name: str) -> str | None:
        """The first header of that name (case-insensitive), None without one."""
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)


def request_sizes(head: bytes, max_body: int) -> tuple[int, int]:
    """(meta length, body length) of a request's head; InvalidInput past the bounds."""
    meta, body = REQUEST_HEAD.unpack(head)
    if meta > MAX_META:
        raise InvalidInput(f"link: request meta of {meta} bytes (at most {MAX_META})")
    if body > max_body:
        raise InvalidInput(f"link: request body of {body} bytes (at most {max_body})")
    return meta, body


def response_sizes(head: bytes, max_body: int) -> tuple[int, int, int]:
    """(status, meta length, body length) of a response's head; InvalidInput past the bounds."""
    status, meta, body = RESPONSE_HEAD.unpack(head)
    if not 100 <= status <= 599 or meta > MAX_META or body > max_body:
        raise InvalidInput(f"link: not a response head (status {status}, meta {meta}, body {body} bytes)")
    return status, meta, body


def request_meta(raw: bytes) -> tuple[str, str, Headers]:
    """(method, path, headers) of a request's meta; InvalidInput naming what is wrong."""
    data = _json(raw, "request")
    method, path = data.get("method"), data.get("path")
    if method not in METHODS:
        raise InvalidInput(f"link: method {str(method)[:20]!r} (one of {', '.join(METHODS)})")
    if not isinstance(path, str) or not path.startswith("/") or len(path) > 8192 or not path.isascii():
        raise InvalidInput("link: path: an ASCII path starting with '/', at most 8192 characters")
    return method, path, _headers(data.get("headers"))


def response_meta(raw: bytes) -> Headers:
    return _headers(_json(raw, "response").get("headers"))


def _json(raw: bytes, what: str) -> dict[str, object]:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise InvalidInput(f"link: {what} meta is not JSON") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"link: {what} meta is not a JSON object")
    return data


def _headers(value: object) -> Headers:
    if not isinstance(value, list) or len(value) > MAX_HEADERS:
        raise InvalidInput(f"link: headers: a list of at most {MAX_HEADERS} [name, value] pairs")
    out = []
    for pair in value:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)
                and _TOKEN.fullmatch(pair[0]) and _FIELD_VALUE.fullmatch(pair[1])):
            raise InvalidInput("link: headers: each a [name, value] pair: a name of HTTP token characters, a value "
                               "of Latin-1 characters without control characters (as HTTP/1.1 carries them)")
        out.append((pair[0], pair[1]))
    return tuple(out)


_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
