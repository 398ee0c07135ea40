"""The ladder's forecast of a model's next arrival, as the warm pool sizes idle capacity by it.

`ArrivalForecast` turns the ladder's per-cell hazards into a survival function (the simulator's lp-buffer node,
`ember.sim.warm_pool_sim`, evaluates many rows at once); `LadderForecast` is the live server's: one model's history
and idle time so far in, the chance of a request within the coming period out (`ember.serving.warmpool`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ember.keepalive.forecast import HistoryTable, IdleHistory
from ember.keepalive.policies import LadderPolicy


class ArrivalForecast:
    """The ladder's forecast of idle periods (`LadderPolicy.hazards`: the chance of an arrival in each cell
    given idle at its start, prior-smoothed, an exponential tail beyond the range), as a survival function with
    a constant hazard within each cell; one row per model of `table`."""

    def __init__(self, ladder: LadderPolicy, table: HistoryTable) -> None:
        h = np.clip(ladder.hazards(table), 0.0, 1.0 - 1e-12)     # (m, cells), the last one the tail, per bin
        self.starts = ladder.cell_starts(table.spec)
        self.log_keep = np.log1p(-h)
        self.cum = np.concatenate([np.zeros((len(h), 1)), np.cumsum(self.log_keep[:, :-1], axis=1)], axis=1)
        self.width = np.append(np.diff(self.starts), ladder.bin_s)   # the tail repeats its per-bin hazard

    def _log_survival(self, r: np.ndarray, x: np.ndarray) -> np.ndarray:
        c = np.clip(np.searchsorted(self.starts, x, side="right") - 1, 0, len(self.starts) - 1)
        return self.cum[r, c] + (x - self.starts[c]) / self.width[c] * self.log_keep[r, c]

    def chance(self, rows: np.ndarray, idle_s: np.ndarray, period_s: float) -> np.ndarray:
        """For each of `rows`: the chance of an arrival within `period_s`, given idle for `idle_s` so far."""
        idle = np.maximum(np.asarray(idle_s, dtype=np.float64), 0.0)
        return 1.0 - np.exp(self._log_survival(rows, idle + period_s) - self._log_survival(rows, idle))


@dataclass(frozen=True)
class LadderForecast:
    """The chance of a request within a period, given a model's idle history and how long it has been idle, by the
    ladder's forecast; the histories it reads are the ladder's (`new_history`)."""

    ladder: LadderPolicy = field(default_factory=LadderPolicy)

    def new_history(self) -> IdleHistory:
        return self.ladder.new_history()

    def chance(self, history: IdleHistory | None, idle_s: float, period_s: float) -> float:
        """The chance of a request within `period_s`, given idle for `idle_s` (the prior alone without history)."""
        forecast = ArrivalForecast(self.ladder, (history or self.new_history()).table())
        return float(forecast.chance(np.zeros(1, dtype=np.int64), np.array([idle_s]), period_s)[0])
