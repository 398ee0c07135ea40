"""RainbowCake: layer-wise keep-alive, one timer per rung (Yu et al., ASPLOS 2024).

RainbowCake ("Mitigating Cold-starts in Serverless with Layer-wise Container Caching and
Sharing") splits a container's start into layers (Bare, Lang, User) and keeps each layer
alive on its own timer: after an execution the full container stays for a while, then is
stripped back to the shared language layer, then to the bare one, then to nothing. In
ember the layers are rungs: the instance (HOT), the model's template (TEMPLATE: weights
loaded), the runtime's zygote (ZYGOTE: imports, shared by the runtime's models), nothing
(FETCH). The plan is "hot for T_hot, then the template for T_template, then the zygote for
T_zygote, then nothing", each timer starting when the one above it ends.

Timer rule (ours; the paper's exact formula could not be checked here, so this is the rule
it describes in words: a layer is kept while its memory waste stays below the start-up
latency it saves, valued by one knob). Keeping rung r instead of the rung below it saves
start(below) - start(r) seconds on the next start and costs idle_mb(r) MB per second, so
keeping it for

    T_r = latency_value * (start_s(below) - start_s(r)) / idle_mb(r)

spends exactly the saving (valued at `latency_value` MB*s per second of start latency, the
ladder's knob, so the two policies sweep the same axis): the ski-rental break-even, which
is 2-competitive against an oracle for one layer. The zygote's memory is divided by the
models sharing it (`zygote_share`), as RainbowCake's sharing-aware cost model does for its
shared layers, which makes the zygote's timer long.

Adaptation to the observed idle times (per model, as RainbowCake adapts its windows to the
function's inter-arrival times): once a model has `min_samples` idle periods, its own layers
(hot, template) are not kept past the `quantile` of its idle times plus `margin`: keeping
them longer than nearly every idle period lasts saves almost nothing. The shared zygote's
timer is not cut (other models use it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ember.core.rung_costs import RungCosts
from ember.keepalive.forecast import HistogramSpec, HistoryTable
from ember.keepalive.idle_plan import COLD, HOT, TEMPLATE, ZYGOTE, PlanTable, PolicyBase, check_knob

_LAYERS = (HOT, TEMPLATE, ZYGOTE)   # the rungs RainbowCake keeps, top first; COLD (nothing) below them


@dataclass(frozen=True)
class RainbowCake(PolicyBase):
    """Layered keep-alive: hot, then the template, then the zygote, each for its break-even time (see module)."""

    name: ClassVar[str] = "rainbowcake"
    knob: ClassVar[str] = "latency_value"
    latency_value: float = 1e5
    costs: RungCosts = field(default_factory=RungCosts)
    zygote_share: float = 1.0
    quantile: float = 0.99
    margin: float = 0.10
    min_samples: int = 10
    max_timer_s: float = 86400.0   # a layer cheaper than this is kept for a day at most (not forever)

    def __post_init__(self) -> None:
        check_knob(self.name, "latency_value", self.latency_value, 0, 1e15)
        check_knob(self.name, "zygote_share", self.zygote_share, 1, 1e9)
        check_knob(self.name, "quantile", self.quantile, 0, 1)
        check_knob(self.name, "margin", self.margin, 0, 10)
        check_knob(self.name, "min_samples", self.min_samples, 1, 1e9)
        check_knob(self.name, "max_timer_s", self.max_timer_s, 0, 1e10)

    @property
    def spec(self) -> HistogramSpec:  # type: ignore[override]
        # Head cells: a busy model's idle periods are sub-second, and the quantile must see them.
        return HistogramSpec(head_splits=8)

    def timers(self) -> np.ndarray:
        """(3,) seconds each of hot, template and zygote is kept, before the adaptation to idle times."""
        mb = self.costs.idle_mb()
        # The shared zygote's part, and the copy in the memory tier that only dropping to nothing releases.
        mb[ZYGOTE] = mb[ZYGOTE] / self.zygote_share + self.costs.memory_copy_mb
        lat = self.costs.start_s()
        below = np.array([TEMPLATE, ZYGOTE, COLD])
        saved = np.maximum(lat[below] - lat[list(_LAYERS)], 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(mb[list(_LAYERS)] > 0, self.latency_value * saved / mb[list(_LAYERS)], np.inf)
        return np.minimum(np.where(saved > 0, t, 0.0), self.max_timer_s)

    def idle_quantile(self, table: HistoryTable) -> np.ndarray:
        """(m,) the upper edge of the cell holding the `quantile` of each row's idle times (inf: too few)."""
        spec = table.spec
        later = table.cols >= 1
        uppers = np.concatenate([spec.head_edges[1:], (table.cols[later] + 1) * spec.bin_s, [np.inf]])
        counts = np.concatenate([table.head_counts, table.counts[:, later], table.oob[:, None]], axis=1)
        cum = np.cumsum(counts, axis=1)
        total = cum[:, -1:]
        at = np.argmax(cum >= self.quantile * total - 1e-9, axis=1)
        return np.where(table.total >= self.min_samples, uppers[at], np.inf)

    def plans(self, table: HistoryTable, need_s: np.ndarray | None = None) -> PlanTable:
        m = table.rows
        t_hot, t_tpl, t_zyg = self.timers()
        cap = self.idle_quantile(table) * (1.0 + self.margin)
        own_end = np.minimum(t_hot + t_tpl, cap)                 # the model's own layers end here
        hot_end = np.minimum(t_hot, own_end)
        zyg_end = np.maximum(own_end, t_hot + t_tpl + t_zyg) if np.isfinite(t_zyg) else np.full(m, np.inf)
        breaks = np.stack([np.zeros(m), hot_end, own_end, zyg_end], axis=1)
        codes = np.tile(np.array([HOT, TEMPLATE, ZYGOTE, COLD], dtype=np.int8), (m, 1))
        return _squeeze(breaks, codes)

    def sweep(self) -> tuple[float, ...]:
        return tuple(float(v) for v in np.logspace(2, 7, 11))


def _squeeze(breaks: np.ndarray, codes: np.ndarray) -> PlanTable:
    """Drop empty steps (a timer of 0, or a step cut away by the cap): the engine wants increasing breaks."""
    m = breaks.shape[0]
    nxt = np.concatenate([breaks[:, 1:], np.full((m, 1), np.inf)], axis=1)
    keep = nxt > breaks
    keep[:, 0] |= ~keep.any(axis=1)
    keep &= np.isfinite(breaks)
    rank = np.cumsum(keep, axis=1) - 1
    width = int(rank[:, -1].max()) + 1 if m else 1
    out_b = np.full((m, width), np.inf)
    out_c = np.full((m, width), COLD, dtype=np.int8)
    rows, cols = np.nonzero(keep)
    out_b[rows, rank[rows, cols]] = breaks[rows, cols]
    out_c[rows, rank[rows, cols]] = codes[rows, cols]
    out_b[:, 0] = 0.0
    return PlanTable(out_b, out_c)
