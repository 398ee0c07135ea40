"""A streaming model for the node tests: `n` replies {"i": [k]} for k = 0..n-1, `sleep_s` apart.

Both come from the inputs. Option `count_file`: after each reply it writes {"yielded", "closed"} there
as JSON, and once more with closed true when the generator finishes or is closed, so a test can see
where a cancelled or timed-out stream stopped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np


class Streamer:
    def __init__(self) -> None:
        self.count_file: Path | None = None

    def load(self, weights: Path | None, options: dict[str, Any]) -> None:
        self.count_file = Path(options["count_file"]) if options.get("count_file") else None

    def stream(self, inputs: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        n, pause = int(inputs["n"][0]), float(inputs["sleep_s"][0])
        yielded = 0
        try:
            for k in range(n):
                if k:
                    time.sleep(pause)
                yielded += 1
                self._note(yielded, closed=False)
                yield {"i": np.array([k], dtype=np.int64)}
        finally:
            self._note(yielded, closed=True)

    def _note(self, yielded: int, closed: bool) -> None:
        if self.count_file is not None:
            tmp = self.count_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"yielded": yielded, "closed": closed}))
            tmp.replace(self.count_file)
