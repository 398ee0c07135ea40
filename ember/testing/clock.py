"""A clock that moves only when told to."""

from __future__ import annotations


class FakeClock:
    """Implements `ember.core.clock.Clock`; `advance()` moves time forward."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self._now += seconds
        return self._now

    def set(self, now: float) -> None:
        if now < self._now:
            raise ValueError("a clock does not go backwards")
        self._now = now
