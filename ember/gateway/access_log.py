"""The access log: one line per request (method, route, model, version, status, rung, latency, bytes), as text or
JSON, to the `ember.access` logger. Off unless `ember serve --access-log text|json`.

Latency is to the response's start: for a stream (SSE, chunked) that is the time to its first byte, and its
size is unknown (`-` in text, null in JSON) since the body is still being sent when the line is written.
"""

from __future__ import annotations

import json
import logging
from typing import Literal

from starlette.requests import Request
from starlette.responses import Response

from ember.metrics import split_key

Format = Literal["text", "json"]
log = logging.getLogger("ember.access")


class AccessLog:
    def __init__(self, fmt: Format) -> None:
        self.fmt = fmt

    def record(self, request: Request, response: Response, model: str, api: str, latency_s: float) -> None:
        name, version = split_key(model)
        size = response.headers.get("content-length")
        fields = {"method": request.method, "route": request.url.path, "api": api, "model": name,
                  "version": version, "status": response.status_code,
                  "rung": response.headers.get("ember-rung", ""), "latency_ms": round(latency_s * 1e3, 3),
                  "bytes": int(size) if size is not None else None}
        if self.fmt == "json":
            log.info(json.dumps(fields, separators=(",", ":")))
            return
        log.info("%s %s %s %s:%s %d %s %.3fms %s", fields["method"], fields["route"], api, name or "-",
                 version or "-", response.status_code, fields["rung"] or "-", latency_s * 1e3,
                 size if size is not None else "-")
