"""How fast a model finishes requests, and so how long a queued request will wait.

`ThroughputMeter` counts completions over a sliding window of `now` values (no clock of its own);
`expected_wait_s` turns a queue position into the wait a 202's `Retry-After` announces.
"""

from __future__ import annotations

import math
from collections import deque


class ThroughputMeter:
    """Completions per second over the last `window_s` seconds."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._done: deque[float] = deque()

    def completed(self, now: float) -> None:
        self._done.append(now)
        self._trim(now)

    def rate(self, now: float, min_span_s: float = 1e-3) -> float | None:
        """Requests per second, or None before there are two completions to measure between; over at least
        `min_span_s` (two completions a millisecond apart after an idle spell are no measure of capacity)."""
        self._trim(now)
        if len(self._done) < 2:
            return None
        span = max(now - self._done[0], min_span_s)
        return len(self._done) / span

    def _trim(self, now: float) -> None:
        while self._done and self._done[0] < now - self.window_s:
            self._done.popleft()


def drain_s(waiting: int, rate: float | None, unmeasured_s: float) -> float:
    """Seconds to work through `waiting` requests at `rate` per second, `unmeasured_s` each where no rate is known."""
    if waiting <= 0:
        return 0.0
    return waiting / rate if rate else waiting * unmeasured_s


def expected_wait_s(ahead: int, rate: float | None, fallback_s: float, *, floor_s: float = 1.0,
                    ceiling_s: float = 3600.0) -> float:
    """When a request with `ahead` requests before it will be served, at `rate` per second (None: unknown)."""
    if rate is None or rate <= 0:
        return max(floor_s, fallback_s)
    return min(ceiling_s, max(floor_s, math.ceil((ahead + 1) / rate)))
