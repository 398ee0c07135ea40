"""A model with a sleep mode, for the node tests of the sleep rungs: its "weights" are an array of `mb` MB it builds
from a seed at load (option `mb`, default 64); `y = x * weights.mean()`.

Level 1 keeps the weights (nothing else to offload on a CPU); level 2 discards them, so the process gives their pages
back, and `wake_up` builds them again. Each reports None: the node counts its resident memory. Option `hang_s`: a
sleep that takes that long (a hung engine). `wake_up` counts its calls in `wakes`, which `y`'s second value reports.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np


class Sleeper:
    sleep_levels = (1, 2)

    def __init__(self) -> None:
        self.weights: np.ndarray | None = None
        self.mb = 64
        self.level = 0
        self.hang_s = 0.0
        self.wakes = 0

    def load(self, weights: Path | None, options: dict[str, Any]) -> None:
        self.mb = int(options.get("mb", 64))
        self.hang_s = float(options.get("hang_s", 0.0))
        self._build()

    def _build(self) -> None:
        rows = self.mb * 2**20 // 8 // 1024
        self.weights = np.random.default_rng(7).random((rows, 1024))

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.weights is None:
            raise RuntimeError("asked to infer while asleep")
        y = (inputs["x"] * np.float32(self.weights.mean())).astype(np.float32)
        y[-1] = self.wakes
        return {"y": y}

    def sleep(self, level: int) -> None:
        time.sleep(self.hang_s)
        self.level = level
        if level == 2:
            self.weights = None

    def wake_up(self) -> None:
        self.wakes += 1
        if self.weights is None:
            self._build()
        self.level = 0
