"""A real nginx serving a directory on 127.0.0.1, as the weight store's remote origin in tests and benches.

Runs in the foreground (daemon off, no master) as one process with its own config, pid, temp and log paths,
so it needs no root and leaves nothing behind. `/` serves the directory; `/slow/` serves it throttled (for
killing a fetch halfway). The access log (one line per request) shows which chunks were fetched and when.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from ember.ports import free_port

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"

_CONF = """
daemon off;
master_process off;
worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log {work}/access.log;
    client_body_temp_path {work}/body;
    proxy_temp_path {work}/proxy;
    fastcgi_temp_path {work}/fastcgi;
    uwsgi_temp_path {work}/uwsgi;
    scgi_temp_path {work}/scgi;
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000;
    server {{
        listen {host}:{port};
        root {root};
        location /slow/ {{
            alias {root}/;
            limit_rate {slow_rate};
        }}
    }}
}}
"""


def available() -> bool:
    return os.path.exists(NGINX)


class NginxOrigin:
    def __init__(self, root: Path, slow_rate: str = "1m", host: str = "127.0.0.1") -> None:
        """`host`: the address it listens on (a network namespace's bridge: nodes in namespaces reach it)."""
        self.root, self.host = root, host
        self.slow_rate = slow_rate
        self.port = 0
        self.work = Path(tempfile.mkdtemp(prefix="ember-nginx-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    @property
    def slow_url(self) -> str:
        return f"http://{self.host}:{self.port}/slow/"

    def start(self) -> NginxOrigin:
        self.port = self.port or free_port()
        conf = self.work / "nginx.conf"
        conf.write_text(_CONF.format(work=self.work, port=self.port, host=self.host, root=self.root,
                                     slow_rate=self.slow_rate))
        cmd = [NGINX, "-p", str(self.work), "-c", str(conf), "-e", str(self.work / "error.log")]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                raise RuntimeError(f"nginx exited at start: {err} {self.error_log()}")
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.2):
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"nginx did not listen on {self.host}:{self.port}")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc is not None and self._proc.stderr is not None:
            self._proc.stderr.close()
        self._proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.work, ignore_errors=True)

    def error_log(self) -> str:
        with contextlib.suppress(FileNotFoundError):
            return (self.work / "error.log").read_text()
        return ""

    def requests(self) -> list[str]:
        """Request paths in the order nginx logged them."""
        with contextlib.suppress(FileNotFoundError):
            lines = (self.work / "access.log").read_text().splitlines()
            return [line.split('"')[1].split(" ")[1] for line in lines if line.count('"') >= 2]
        return []

    def __enter__(self) -> NginxOrigin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
