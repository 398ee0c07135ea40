"""A probe model for the node tests: it doubles `x` and reports what its process looks like.

`cmd` (one BYTES element) steers it: b"sleep:SECONDS" sleeps first, b"raise" raises a plain
exception, b"reject" raises InvalidInput, b"pretend-crash" raises WorkerCrashed, b"exit:CODE"
kills the process; anything else (the warmup sentence included) just answers. `info` is, in order: pid, the pid that ran
load(), calls so far in this process, a draw from `random`, a draw from numpy, the CPU
affinity bit mask, OMP_NUM_THREADS, and when the call began and ended (monotonic ns).
Option `ballast_mb` loads that many MB of "weights"; `load_sleep_s` makes load() take that long.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from ember.errors import InvalidInput, WorkerCrashed


class Probe:
    def __init__(self) -> None:
        self.calls = 0
        self.load_pid = 0
        self.ballast = np.zeros(0)

    def load(self, weights: Path | None, options: dict[str, Any]) -> None:
        self.load_pid = os.getpid()
        time.sleep(float(options.get("load_sleep_s", 0)))
        size = int(options.get("ballast_mb", 0)) * (1 << 20) // 8
        self.ballast = np.full(size, 1.5)  # written, so resident: shared copy-on-write after a fork

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls += 1
        began = time.monotonic_ns()
        cmd = bytes(inputs["cmd"].reshape(-1)[0])
        if cmd.startswith(b"sleep:"):
            time.sleep(float(cmd[6:]))
        elif cmd == b"raise":
            raise RuntimeError("probe was told to fail")
        elif cmd == b"reject":
            raise InvalidInput("input 'x': the probe rejects it")
        elif cmd == b"pretend-crash":
            raise WorkerCrashed("the probe pretends to have crashed")
        elif cmd.startswith(b"exit:"):
            os._exit(int(cmd[5:]))
        mask = sum(1 << c for c in os.sched_getaffinity(0))
        info = [os.getpid(), self.load_pid, self.calls, random.getrandbits(62), int(np.random.randint(1 << 62)),
                mask, int(os.environ.get("OMP_NUM_THREADS", "0")), began, time.monotonic_ns()]
        return {"y": (inputs["x"] * 2).astype(np.float32), "info": np.array(info, dtype=np.int64)}
