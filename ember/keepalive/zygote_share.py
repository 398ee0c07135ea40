"""How often other models hold a runtime's zygote: the share the ladder prices the zygote by, live.

`LadderPolicy` prices a runtime's zygote at its marginal cost: nothing while some other model of
the runtime holds it anyway (`LadderPolicy.zygote_price`). The simulator feeds it the share of the
past hour in which others held it (`ember.sim.batched`, `ember.sim.zygotes`); `ZygoteShares` keeps
the same figure on a live node from what the serving loop sees on each tick: per model, its runtime
and whether it holds the zygote now (`ember.core.lifecycle.zygote_holders`, the rule the node keeps
a zygote by). Between two observations the earlier one holds.

As in the simulator, time is cut into whole minutes from the first observation (the simulator's
from the trace's start), and a model's share is the mean, over the whole minutes of the past hour,
of the share of each minute in which some other model of its runtime held the zygote; minutes
before the model was first seen count (others held the zygote then or not), and before a whole
minute has passed there is no share (None: the ladder then splits the zygote evenly). Unlike the
simulator, which takes the models' holds within a minute as independent, the live share is exact:
the seconds in which some model held it, less those in which the model alone did.

Pure and clock-free: each observation is given its time, and returns a new value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ember.errors import InvalidInput

# The window over which the share is observed, in whole minutes (the simulator's too: `ember.sim.batched`).
WINDOW_S = 3600.0
MINUTE_S = 60.0


@dataclass(frozen=True)
class Minute:
    """One minute's holds: per runtime, the seconds some model of it held its zygote; per model, the seconds it
    alone did (so some other did for the runtime's less the model's)."""

    index: int
    any_s: Mapping[str, float]
    alone_s: Mapping[str, float]


@dataclass(frozen=True)
class ZygoteShares:
    """Per model, the share of the past hour's whole minutes in which another model of its runtime held the
    zygote; `observe` each tick, `share` when planning."""

    window_s: float = WINDOW_S
    minute_s: float = MINUTE_S
    origin: float | None = None                      # the first observation: minute 0 begins here
    at: float | None = None                          # the latest observation
    holding: Mapping[str, tuple[str, bool]] = field(default_factory=dict)   # since `at`: model -> (runtime, holds)
    minutes: tuple[Minute, ...] = ()                 # the window's minutes with a hold, oldest first

    def __post_init__(self) -> None:
        if not (self.minute_s > 0 and self.window_s >= self.minute_s):
            raise InvalidInput(f"zygote share: need 0 < minute_s <= window_s, got {self.minute_s}, {self.window_s}")

    def observe(self, now: float, holding: Mapping[str, tuple[str, bool]]) -> ZygoteShares:
        """These shares once what was seen at the last observation has held until `now`, and `holding` (per model:
        its runtime, and whether it holds the zygote) holds from now on. A clock seen going back adds no time."""
        if self.origin is None or self.at is None:
            return ZygoteShares(self.window_s, self.minute_s, now, now, dict(holding))
        now = max(now, self.at)
        minutes = _prune(self._held(self.at, now), self._index(now) - self._window())
        return ZygoteShares(self.window_s, self.minute_s, self.origin, now, dict(holding), minutes)

    def share(self, model: str) -> float | None:
        """The share of the past hour's whole minutes in which some other model of `model`'s runtime held the
        zygote; None for a model not seen at the latest observation, or before a whole minute has passed."""
        if self.at is None or model not in self.holding:
            return None
        now = self._index(self.at)
        n = min(now, self._window())
        if n <= 0:
            return None
        runtime = self.holding[model][0]
        others = sum(m.any_s.get(runtime, 0.0) - m.alone_s.get(model, 0.0)
                     for m in self.minutes if now - n <= m.index < now)
        return min(1.0, max(0.0, others / (n * self.minute_s)))

    def _held(self, start: float, end: float) -> tuple[Minute, ...]:
        """`minutes` with [start, end) held as `holding` says, minute by minute (the window's minutes only)."""
        runtimes = {r for r, held in self.holding.values() if held}
        holders = {r: [k for k, (rr, held) in self.holding.items() if held and rr == r] for r in runtimes}
        alone = [ks[0] for ks in holders.values() if len(ks) == 1]
        by_index = {m.index: m for m in self.minutes}
        first = max(self._index(start), self._index(end) - self._window())
        for i in range(first, self._index(end) + 1):
            lo = max(start, self._begins(i))
            seconds = min(end, self._begins(i + 1)) - lo
            if seconds <= 0 or not runtimes:
                continue
            m = by_index.get(i, Minute(i, {}, {}))
            by_index[i] = Minute(i, _added(m.any_s, runtimes, seconds), _added(m.alone_s, alone, seconds))
        return tuple(by_index[i] for i in sorted(by_index))

    def _index(self, t: float) -> int:
        return int((t - (self.origin or 0.0)) // self.minute_s)

    def _begins(self, index: int) -> float:
        return (self.origin or 0.0) + index * self.minute_s

    def _window(self) -> int:
        return round(self.window_s / self.minute_s)


def _added(seconds: Mapping[str, float], keys: set[str] | list[str], add: float) -> dict[str, float]:
    out = dict(seconds)
    for k in keys:
        out[k] = out.get(k, 0.0) + add
    return out


def _prune(minutes: tuple[Minute, ...], first: int) -> tuple[Minute, ...]:
    """The minutes from `first` on: the older ones have left every window."""
    return tuple(m for m in minutes if m.index >= first)


__all__ = ["MINUTE_S", "WINDOW_S", "Minute", "ZygoteShares"]
