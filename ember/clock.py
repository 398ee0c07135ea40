"""The system clock adapter: the only place the live server reads time for decisions."""

from __future__ import annotations

import time


class SystemClock:
    """Monotonic seconds from the OS (immune to wall-clock jumps)."""

    def now(self) -> float:
        return time.monotonic()
