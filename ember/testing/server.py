"""A real `ember serve` subprocess on a free loopback port, for end-to-end tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from ember.ports import free_port


class EmberServer:
    """`python -m ember serve ...` on a free loopback port; waits for /v2/health/ready.

    With `--models` among `args` it serves only those models (`--no-examples`), unless `examples=True`: tests
    and benchmarks expect their own models alone, and the bundled LLM costs seconds and memory to load.
    """

    def __init__(self, state_dir: Path, *args: str, port: int | None = None, env: dict[str, str] | None = None,
                 examples: bool | None = None, cwd: Path | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state_dir = state_dir
        wanted = examples if examples is not None else "--models" not in args
        if not wanted and "--no-examples" not in args:
            args = (*args, "--no-examples")
        if "--grpc-port" not in args:   # no gRPC unless asked for: test servers run side by side
            args = (*args, "--grpc-port", "0")
        self.args = args
        self.log = state_dir / f"serve-{self.port}.log"
        self.extra_env = env or {}
        self.cwd = cwd   # the server's working directory (None: this process's)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_timeout: float = 90) -> EmberServer:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **self.extra_env}
        cmd = [sys.executable, "-m", "ember", "serve", "--port", str(self.port),
               "--state-dir", str(self.state_dir), *self.args]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd)
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ember serve exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/v2/health/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"ember serve not ready in {ready_timeout}s:\n{self.log.read_text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def status(self) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(self.url + "/ember/status", timeout=10).json()
        return data

    def instances(self, model: str) -> list[dict[str, Any]]:
        """The model's instances as `ember status` lists them."""
        models = {m["name"]: m for m in self.status()["models"]}
        found: list[dict[str, Any]] = models[model]["instances"]
        return found

    def __enter__(self) -> EmberServer:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()



def wait_for(predicate: Callable[[], Any], timeout: float = 30) -> Any:
    """Poll `predicate` until it returns something true (and return that); AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")
