"""A batching model for the node tests: y = 2 * x, and `batch`, the rows of the forward pass that served it.

Its contract batches (max_batch_size 16), so `infer` gets several requests' rows at once. Any negative x
makes the whole call fail (ValueError), so one bad request spoils the batch it is in. Options: `sleep_s`,
how long each forward pass takes; `log`, a file that gets one JSON line per call: {"rows", "bad"}.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np


class Batcher:
    def __init__(self) -> None:
        self.sleep_s = 0.0
        self.log: Path | None = None

    def load(self, weights: Path | None, options: dict[str, Any]) -> None:
        self.sleep_s = float(options.get("sleep_s", 0))
        self.log = Path(options["log"]) if options.get("log") else None

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        rows = x.shape[0]
        bad = bool((x < 0).any())
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(json.dumps({"rows": rows, "bad": bad}) + "\n")
        time.sleep(self.sleep_s)
        if bad:
            raise ValueError("the batcher takes no negative x")
        return {"y": (x * 2).astype(np.float32), "batch": np.full(rows, rows, dtype=np.int64)}
