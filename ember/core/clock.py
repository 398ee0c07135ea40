"""The clock the core is given: decisions take `now` from it, never from the system."""

from __future__ import annotations

from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds. The live server injects a system clock, tests a FakeClock."""

    def now(self) -> float: ...
