"""An ASGI app served by a real uvicorn on a loopback port, in a thread of the test's process."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from ember.gateway.connections import guarded_protocol


class ThreadedServer:
    """`with ThreadedServer(app) as server:` serves `app` on 127.0.0.1:`server.port` (a free one unless `port`)
    until the block ends."""

    def __init__(self, app: Any, *, port: int = 0, log_level: str = "warning", name: str = "asgi-server",
                 **uvicorn_config: Any) -> None:
        """`uvicorn_config`: more of uvicorn's settings (TLS: `NodeTls.server_kwargs()`; `http`: a protocol, by
        default the gateway's own, which also takes gateway links, as `ember serve` does)."""
        uvicorn_config.setdefault("http", guarded_protocol(10.0, 1000))
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self.port: int = self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off", access_log=False,
                                                     **uvicorn_config))
        self._scheme = "https" if "ssl_certfile" in uvicorn_config else "http"
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=f"{name}-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"{self._scheme}://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> ThreadedServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"uvicorn on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
