"""Keep-alive and pre-warm policies: where a model's idle capacity sits while it waits.

Every policy answers one question: after an execution ends, which rung should the
model's idle capacity sit on at each moment of the idle period that follows? The answer
is an `IdlePlan`, a step function of idle time (seconds since the execution ended) onto
rungs of the ladder, cheapest to start first:

    HOT       a running idle instance                 (full memory, ~0.3 ms to start)
    PAUSED    the instance frozen with SIGSTOP         (same memory, no CPU, ~0.8 ms)
    TEMPLATE  only the per-model template process     (~85 ms: fork it)
    ZYGOTE    only the runtime's zygote, shared       (~300 ms: fork, load, warm up)
    FETCH     nothing kept: the full cold start       (~12.5 s: start, import, load)

Policies are pure: they read idle-time statistics (`ember.keepalive.forecast`) and return
plans; the live server walks an instance down its plan on its own clock, the simulator
evaluates plans against traces. The plans, the levels and the policy interface are in
`ember.keepalive.idle_plan`; this module holds three policies and the registry of them by name
(`POLICIES`, `make_policy`), and `ember.sim.keepalive_layered` the RainbowCake baseline:

- `FixedKeepAlive`: hot for a fixed time (10 minutes, the classic provider default), then nothing.
- `HybridHistogram`: the hybrid histogram policy of Shahrad et al. (ATC 2020).
- `LadderPolicy`: ember's policy, a rung per cell of the idle period (finer in its first minute) by expected cost;
  `LadderCold` the same swept along the cold-start objective (`cold_value`) instead of latency.

The rung costs are parameters (`RungCosts`); the defaults are the reference figures for
MiniLM on the development machine, and bench/cold_start.py measures them for real
(`RungCosts.from_benchmark` loads its JSON).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from ember.core.rung_costs import RungCosts
from ember.core.states import Rung
from ember.errors import InvalidInput
from ember.keepalive import ladder_cells
from ember.keepalive.forecast import (
    MAX_BINS,
    HistogramSpec,
    HistoryTable,
    IdleHistory,
    arima_forecast,
)
from ember.keepalive.idle_plan import (
    COLD,
    DAY_S,
    HOT,
    LEVELS,
    NEW_PROCESS,
    ZYGOTE,
    IdlePlan,
    KeepAlivePolicy,
    PlanTable,
    PolicyBase,
    check_floor,
    check_knob,
)
from ember.keepalive.ladder_cells import Grid
from ember.keepalive.pooled_prior import PooledPrior, pool_censored

# The ladder's most minute bins: its per-cell arithmetic works on (cells, 8,192 rows) temporaries, ~94 MB each at
# this many (the class default has 240, the held-out tuning up to 480).
LADDER_MAX_BINS = 1440


@dataclass(frozen=True)
class FixedKeepAlive(PolicyBase):
    """Keep the instance hot for `keep_alive_s` after each execution, then drop it."""

    name: ClassVar[str] = "fixed"
    knob: ClassVar[str] = "keep_alive_s"
    keep_alive_s: float = 600.0
    spec: HistogramSpec = field(default_factory=HistogramSpec)
    floor: int = COLD   # where it drops to: nothing (the paper), or ZYGOTE (SOCK's zygotes)

    def __post_init__(self) -> None:
        check_knob(self.name, "keep_alive_s", self.keep_alive_s, 0, float("inf"))   # inf: kept for ever
        check_floor(self.name, self.floor)

    def plans(self, table: HistoryTable, need_s: np.ndarray | None = None) -> PlanTable:
        return PlanTable.constant(table.rows, [(0.0, HOT), (self.keep_alive_s, self.floor)])

    def sweep(self) -> tuple[float, ...]:
        # From a second: short keep-alives are where a zygote floor makes the fixed policy cheap.
        return (1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0)


@dataclass(frozen=True)
class FixedZygote(FixedKeepAlive):
    """Fixed keep-alive that drops to the zygote, not to nothing (SOCK's zygotes)."""

    name: ClassVar[str] = "fixed-zygote"
    floor: int = ZYGOTE


@dataclass(frozen=True)
class HybridHistogram(PolicyBase):
    """The hybrid histogram policy of "Serverless in the Wild" (Shahrad et al., ATC 2020).

    Per application, idle times go into 1-minute bins over `range_s` (4 hours). Then:
    - mostly out of range (share of out-of-bound idle times >= `oob_threshold`): forecast the
      next idle time with ARIMA; pre-warm at forecast x (1 - 15%), keep alive for 2 x 15% of it;
    - histogram not representative (coefficient of variation of the bin counts < `cv_threshold`,
      which includes an empty one): the conservative default, hot from the end for the whole range;
    - otherwise: pre-warm at the lower edge of the 5th-percentile bin minus 10%, and unload at the
      upper edge of the 99th-percentile bin plus 10%. A pre-warm of 0 keeps the instance from the end.
    """

    name: ClassVar[str] = "hybrid"
    knob: ClassVar[str] = "range_s"
    range_s: float = 4 * 3600.0
    bin_s: float = 60.0
    head_pct: float = 5.0
    tail_pct: float = 99.0
    margin: float = 0.10
    cv_threshold: float = 2.0
    oob_threshold: float = 0.5
    arima_margin: float = 0.15
    min_samples: int = 10   # fewer idle times than this are no histogram: the conservative default applies
    floor: int = COLD

    def __post_init__(self) -> None:
        check_floor(self.name, self.floor)
        check_knob(self.name, "bin_s", self.bin_s, 0.01, 86400)
        check_knob(self.name, "range_s", self.range_s, self.bin_s, self.bin_s * MAX_BINS)
        check_knob(self.name, "min_samples", self.min_samples, 1, 1e9)
        check_knob(self.name, "head_pct", self.head_pct, 0, 100)
        check_knob(self.name, "tail_pct", self.tail_pct, self.head_pct, 100)
        check_knob(self.name, "margin", self.margin, 0, 1)
        check_knob(self.name, "cv_threshold", self.cv_threshold, 0, 1e9)
        check_knob(self.name, "oob_threshold", self.oob_threshold, 0, 1)
        check_knob(self.name, "arima_margin", self.arima_margin, 0, 1)

    @property
    def spec(self) -> HistogramSpec:  # type: ignore[override]
        return HistogramSpec(self.bin_s, self.range_s)

    def plans(self, table: HistoryTable, need_s: np.ndarray | None = None) -> PlanTable:
        m = table.rows
        total = table.total
        prewarm = np.zeros(m)
        unload = np.full(m, self.range_s)   # the conservative default
        oob_rate = np.where(total > 0, table.oob / np.maximum(total, 1), 0.0)
        certain = (total > 0) & (oob_rate < self.oob_threshold) & (table.cv() >= self.cv_threshold)
        certain &= (table.in_range > 0) & (total >= self.min_samples)   # one idle time is not a distribution
        if certain.any():
            head, tail = table.percentile_bins(certain, self.head_pct / 100.0, self.tail_pct / 100.0)
            prewarm[certain] = head * self.bin_s * (1.0 - self.margin)
            unload[certain] = (tail + 1) * self.bin_s * (1.0 + self.margin)
        for row in np.flatnonzero((total > 0) & (oob_rate >= self.oob_threshold)):
            predicted = arima_forecast(table.recent(int(row)))
            if predicted > 0:
                prewarm[row] = predicted * (1.0 - self.arima_margin)
                unload[row] = predicted * (1.0 + self.arima_margin)
        return _hot_window_table(prewarm, unload, self.floor)

    def sweep(self) -> tuple[float, ...]:
        return tuple(h * 3600.0 for h in (0.5, 1.0, 2.0, 3.0, 4.0, 6.0))


@dataclass(frozen=True)
class HybridZygote(HybridHistogram):
    """The hybrid histogram policy dropping to the zygote outside its hot window."""

    name: ClassVar[str] = "hybrid-zygote"
    floor: int = ZYGOTE


def _hot_window_table(prewarm: np.ndarray, unload: np.ndarray, floor: int = COLD) -> PlanTable:
    """Plans "`floor` until prewarm, hot until unload, `floor` after" (hot from 0 if prewarm is 0)."""
    m = len(prewarm)
    breaks = np.full((m, 3), np.inf)
    codes = np.full((m, 3), floor, dtype=np.int8)
    warm_from_end = prewarm <= 0
    breaks[:, 0] = 0.0
    codes[warm_from_end, 0] = HOT
    breaks[warm_from_end, 1] = unload[warm_from_end]
    later = ~warm_from_end
    breaks[later, 1] = prewarm[later]
    codes[later, 1] = HOT
    breaks[later, 2] = np.maximum(unload[later], prewarm[later])
    return PlanTable(breaks, codes)


@dataclass(frozen=True)
class LadderPolicy(PolicyBase):
    """ember's policy: per cell of the idle period, the rung with the least expected cost.

    The idle period is cut into cells: the first minute into `head_splits` + 1 head cells that
    halve towards 0 (with 8: 0, 0.23, 0.47, 0.94, 1.9, 3.75, 7.5, 15 and 30 s), then 1-minute
    bins up to `range_s`, then the tail. For each cell c, given the model is still idle when it
    begins, the forecast gives the chance h_c that the next request arrives within it.
    Holding rung r through the cell costs its memory for the (expected) time held plus, with
    chance h_c, its start latency valued at `latency_value` MB*s per second:

        cost(r, c) = idle_mb[r] * held_c + latency_value * h_c * start_s[r]

    where held_c is the expected time held in the cell: E[min(idle, end) - start | idle >= start]
    from the idle times seen in the head cells, and bin_s * (1 - h_c / 2) in later ones. The operator
    states the objective: `cold_value` MB*s is charged besides for every start that needs a new process
    (template, zygote or nothing kept: what the ATC'20 paper counts as a cold start), so
    `latency_value` alone minimises idle memory plus valued mean latency, `cold_value` alone idle memory
    plus valued cold-start count (`LadderCold` sweeps it), and both a mix:

        cost(r, c) = idle_mb[r] * held_c + h_c * (latency_value * start_s[r] + cold_value * new_process[r])

    Memory and latency are both additive over the cells, so taking the cheapest rung cell by
    cell minimises the expected total where climbs back take no time (with `climb_lead`, the head's plan is
    chosen over its whole sequence of rungs, each climb charged its lead time: `ember.keepalive.ladder_climbs`);
    pre-warming falls out on its own (a low rung while no request is likely, a higher one when one becomes
    likely), and so does "hot for a few
    seconds, then the zygote" for a bursty model. The head cells matter there: a busy model's
    idle periods are mostly (sub)second, and deciding per minute would keep it hot for a whole
    minute after every burst. The forecast is the app's idle-time histogram smoothed by
    `prior_weight` pseudo-observations of a heavy-tailed prior (log-uniform between
    `prior_min_s` and `prior_max_s`: idle times span a tenth of a second to days, and a new
    model is neither assumed busy nor idle), with an exponential tail beyond the histogram's
    range; each cell's hazard is then shrunk towards its neighbours' by `smooth_weight`
    pseudo-periods at risk, so a cell no period happened to end in is not taken for a safe
    place to drop the model. The runtime's zygote is priced on every level that holds it (all but
    FETCH, the live node's rule) at its marginal cost: nothing while other models hold it anyway
    (`zygote_others`, the share of time they were seen to), else its memory split between the
    `zygote_share` models sharing it.
    """

    name: ClassVar[str] = "ladder"
    knob: ClassVar[str] = "latency_value"
    latency_value: float = 1e5
    costs: RungCosts = field(default_factory=RungCosts)
    zygote_share: float = 1.0
    range_s: float = 4 * 3600.0
    bin_s: float = 60.0
    prior_min_s: float = 0.1
    prior_max_s: float = 86400.0
    prior_weight: float = 1.0
    head_splits: int = 8
    smooth_weight: float = 1.0
    # Pseudo-arrivals at the neighbourhood's hazard each cell's hazard is shrunk by (`ladder_cells.smoothed`).
    smooth_events: float = 0.0
    # Decide at the head cells of this many splits (finer than the statistics' `head_splits`; 0: at those), each
    # statistics cell's chance of an arrival spread over its sub-cells by the log-uniform prior's shape.
    decide_splits: int = 0
    rungs: tuple[Rung, ...] = LEVELS
    # Price the zygote at its marginal cost where the driver says how often others hold it (the simulator and the
    # live server's actuator do, for a runtime of more than one model).
    marginal_zygote: bool = True
    # MB*s per start that needs a new process (template, zygote, fetch), on top of the valued latency.
    cold_value: float = 0.0
    # Charge `cold_value` per start times the app's share of a day's invocations per start: the objective is
    # then each application's cold-start share (the ATC'20 paper's per-app metric), not the count of all.
    cold_per_app: bool = False
    # The share of the prior taken from the pooled one (`ember.keepalive.pooled_prior`) where the driver passes it.
    pooled_weight: float = 0.0
    # Hold the zygote to this share of its break-even time in the cells its statistics cannot judge (0: off; 1: the
    # ski-rental rule there; `ladder_cells.rent_floor`).
    rent_floor: float = 0.0
    # Plan the climbs back to a warmer rung with this share of their lead times (0: as if instant; 1: as the
    # simulator and the live node take them; `ember.keepalive.ladder_climbs`).
    climb_lead: float = 0.0

    def __post_init__(self) -> None:
        check_knob(self.name, "latency_value", self.latency_value, 0, 1e15)
        check_knob(self.name, "cold_value", self.cold_value, 0, 1e15)
        check_knob(self.name, "pooled_weight", self.pooled_weight, 0, 1)
        check_knob(self.name, "bin_s", self.bin_s, 0.01, 86400)
        check_knob(self.name, "range_s", self.range_s, self.bin_s, self.bin_s * LADDER_MAX_BINS)
        check_knob(self.name, "head_splits", self.head_splits, 0, 30)
        check_knob(self.name, "smooth_weight", self.smooth_weight, 0, 1e9)
        check_knob(self.name, "smooth_events", self.smooth_events, 0, 1e9)
        check_knob(self.name, "decide_splits", self.decide_splits, 0, 30)
        check_knob(self.name, "rent_floor", self.rent_floor, 0, 1e3)
        check_knob(self.name, "climb_lead", self.climb_lead, 0, 1e3)
        if self.decide_splits != int(self.decide_splits):
            raise InvalidInput(f"ladder: decide_splits must be a whole number, got {self.decide_splits!r}")
        object.__setattr__(self, "decide_splits", int(self.decide_splits))
        if self.head_splits != int(self.head_splits):
            raise InvalidInput(f"ladder: head_splits must be a whole number, got {self.head_splits!r}")
        object.__setattr__(self, "head_splits", int(self.head_splits))   # --knob passes floats
        check_knob(self.name, "zygote_share", self.zygote_share, 1, 1e9)
        check_knob(self.name, "prior_min_s", self.prior_min_s, 1e-3, 1e9)
        check_knob(self.name, "prior_max_s", self.prior_max_s, self.prior_min_s * 2, 1e10)
        check_knob(self.name, "prior_weight", self.prior_weight, 1e-6, 1e9)
        if Rung.FETCH not in self.rungs:
            raise InvalidInput("ladder: rungs must include fetch (nothing kept)")
        bad = [r for r in self.rungs if r not in LEVELS]
        if bad:
            raise InvalidInput(f"ladder: rungs {bad} are not idle rungs (use {[str(r) for r in LEVELS]})")

    @property
    def spec(self) -> HistogramSpec:  # type: ignore[override]
        return HistogramSpec(self.bin_s, self.range_s, self.head_splits)

    def level_mb(self, zygote_mb: float | None = None) -> np.ndarray:
        """Idle MB per level, the runtime's zygote priced at `zygote_mb` (by default its memory over the models
        sharing it) on every level that holds it: the live node keeps a runtime's zygote while any model of it
        sits at or above the zygote rung (`ember.core.lifecycle.KEEPS`), so only FETCH lets go of it."""
        mb = self.costs.own_mb()
        mb[:COLD] += self.zygote_price() if zygote_mb is None else zygote_mb
        return mb

    def zygote_price(self, others: np.ndarray | float | None = None) -> Any:
        """The zygote's marginal MB for a model while `others` (a share, per row) of the time some other model of
        its runtime holds it anyway: holding it then costs nothing more. Without that share, the even split
        between the models sharing it."""
        z = self.costs.zygote.idle_mb
        if others is None:
            return z / self.zygote_share
        return z * (1.0 - np.clip(others, 0.0, 1.0))

    def _prior_cdf(self, t: np.ndarray) -> np.ndarray:
        lo, hi = self.prior_min_s, self.prior_max_s
        return np.clip(np.log(np.maximum(t, lo) / lo) / np.log(hi / lo), 0.0, 1.0)

    def _prior_below(self, t: np.ndarray) -> np.ndarray:
        """The prior's CDF integrated from 0 to t: E[min(idle, b) - a; idle >= a] = b - a - below(b) + below(a)."""
        lo, hi = self.prior_min_s, self.prior_max_s
        c = np.clip(t, lo, hi)
        return (c * np.log(c / lo) - c + lo) / np.log(hi / lo) + np.maximum(t - hi, 0.0)

    def cell_starts(self, head: HistogramSpec | None = None) -> np.ndarray:
        """Idle time at which each decision cell begins: the head cells of the first minute (finer towards 0,
        see `HistogramSpec.head_splits`), each later minute bin, then the tail beyond the range.

        `head` is the spec of the statistics at hand (a history kept with fewer head cells is decided on those).
        """
        spec = self.spec
        edges = (head or spec).head_edges * (spec.bin_s / (head or spec).bin_s)
        return np.concatenate([edges[:-1], np.arange(1, spec.n_bins + 1) * spec.bin_s])

    def grid(self, head: HistogramSpec) -> Grid:
        """What the decision needs besides the statistics, for statistics kept per `head`; computed once."""
        return _grid(self, head)

    def _grid(self, head: HistogramSpec) -> Grid:
        starts = self.cell_starts(head)
        edges = starts[: head.head_splits + 2, None]
        lo, hi = edges[:-1], edges[1:]
        return Grid(starts, np.diff(self._prior_cdf(starts)),
                    (hi - lo) - (self._prior_below(hi) - self._prior_below(lo)), self._prior_cdf(lo),
                    self.candidates(), self.level_mb(0.0), self.start_value(), head.head_splits + 1, self.bin_s,
                    self.prior_weight, self.smooth_weight, self.smooth_events, self._prior_excess_s(),
                    self._sub_cells(edges[:, 0]), self.rent_floor,
                    self.climb_lead * self.costs.start_s() if self.climb_lead > 0 else None)

    def _sub_cells(self, coarse: np.ndarray) -> ladder_cells.SubCells | None:
        """The decision's sub-cells of the head cells with edges `coarse` (`decide_splits`), None if no finer.

        Within a cell the shape is the log-uniform prior's, its density continued flat below `prior_min_s` (the
        prior itself has none there: a sub-cell below it would get no arrivals, and "nothing kept" would cost
        nothing in it)."""
        if self.decide_splits <= len(coarse) - 2:
            return None
        fine = HistogramSpec(self.bin_s, self.range_s, int(self.decide_splits)).head_edges
        lo, hi = fine[:-1], fine[1:]
        parent = np.searchsorted(coarse, lo, side="right") - 1
        g_lo, g_hi = self._shape(lo), self._shape(hi)
        mass = g_hi - g_lo
        total = np.bincount(parent, weights=mass, minlength=len(coarse) - 1)[parent]
        share = mass / total
        before = np.cumsum(share) - share
        before -= np.concatenate([[0.0], np.cumsum(share)])[np.searchsorted(parent, parent, side="left")]
        # E[t - lo | t in [lo, hi)] = ((hi - lo) G(hi) - integral of G over [lo, hi)) / (G(hi) - G(lo)).
        mean = ((hi - lo) * g_hi - (self._shape_below(hi) - self._shape_below(lo))) / mass
        divided = np.bincount(parent, minlength=len(coarse) - 1)[parent] > 1
        return ladder_cells.SubCells(lo, parent, np.maximum(before, 0.0), share, hi - lo, mean, divided)

    def _shape(self, t: np.ndarray) -> np.ndarray:
        """The sub-cells' shape, unnormalised: (1 + ln(t / lo)) / ln(hi / lo) from lo = `prior_min_s` on (the
        log-uniform CDF plus a constant), t / (lo ln(hi / lo)) below it (its density at lo, flat)."""
        lo, scale = self.prior_min_s, np.log(self.prior_max_s / self.prior_min_s)
        return np.where(t < lo, t / lo, 1.0 + np.log(np.maximum(t, lo) / lo)) / scale

    def _shape_below(self, t: np.ndarray) -> np.ndarray:
        """`_shape` integrated from 0 to t."""
        lo, scale = self.prior_min_s, np.log(self.prior_max_s / self.prior_min_s)
        return np.where(t < lo, t * t / (2 * lo), lo / 2 + t * np.log(np.maximum(t, lo) / lo)) / scale

    def start_value(self, table: HistoryTable | None = None) -> Any:
        """MB*s charged per start from each level ((levels,), or (levels, m) per row of `table` with
        `cold_per_app`): its latency valued at `latency_value`, plus `cold_value` for the levels that need a new
        process (template, zygote, nothing kept), times the app's share of a day's invocations per start with
        `cold_per_app`."""
        latency = self.latency_value * self.costs.start_s()
        if not self.cold_per_app or table is None:
            return latency + self.cold_value * NEW_PROCESS
        return latency[:, None] + self.cold_value * NEW_PROCESS[:, None] * self.day_share(table)[None, :]

    def day_share(self, table: HistoryTable) -> np.ndarray:
        """(m,) how much one start moves an app's cold-start share of a day: its mean idle time over a day, at
        most 1; the mean seen once any period is, the log-uniform prior's mean before.

        Not the prior-smoothed mean: the log-uniform prior's mean is its tail's (6,321 s from 0.1 s to a day,
        45,400 s from 1 s to a week), and as pseudo-periods it held a busy model's charge per start far above its
        own (LLM code, idle 0.39 s on average: 30 times after its 8,000 periods, over 2,000 times after 100), and the
        charge fell all through the trace, so the plans along one trace mixed points of the frontier a fixed hold
        reaches at once (cf56f52^:docs/evaluation-log.md, "The day share")."""
        lo, hi = self.prior_min_s, self.prior_max_s
        prior_mean = (hi - lo) / np.log(hi / lo)
        seen = table.total > 0
        mean = np.where(seen, table.sum_s / np.where(seen, table.total, 1.0), prior_mean)
        return np.minimum(mean / DAY_S, 1.0)

    def prior_masses(self) -> np.ndarray:
        """The log-uniform prior's mass per cell of the grid (the last: beyond the range)."""
        cdf = self._prior_cdf(self.cell_starts())
        return np.append(np.diff(cdf), 1.0 - cdf[-1])

    def pool(self, tables: list[HistoryTable], running_s: list[float | None] | None = None) -> PooledPrior | None:
        """The pooled prior of these one-row histories (the live node's models), for one row; None if unused.
        `running_s`, per history, how long its model has been idle so far (None: not idle), right-censored as in
        the simulator (`ember.keepalive.pooled_prior.kaplan_meier`)."""
        if self.pooled_weight <= 0 or not tables:
            return None
        starts = self.cell_starts(tables[0].spec)
        k = len(starts) - 1
        counts = np.vstack([np.append(ladder_cells.gather(t, t.total, slice(None), k, False).counts[:, 0], t.oob[0])
                            for t in tables])
        heads = np.vstack([t.head_sums[0] for t in tables])
        running = np.array([-1 if r is None else int(np.searchsorted(starts, r, side="right") - 1)
                            for r in (running_s or [None] * len(tables))])
        mass, sums, n = pool_censored(counts, heads, running, self.prior_masses())
        return PooledPrior(mass[None, :], sums[None, :], np.array([n]), np.zeros(1, dtype=np.int64))

    def hazards(self, table: HistoryTable, n: int | None = None, prior: PooledPrior | None = None) -> np.ndarray:
        """(m, n): chance of an arrival in each of the first n cells given idle at its start (`prior`: the pooled
        prior, per row, mixed in by `pooled_weight`).

        n defaults to every cell plus one more for "beyond the range" (an exponential tail);
        see `ember.keepalive.ladder_cells.hazards`.
        """
        grid = self.grid(table.spec)
        full = len(grid.starts)
        n = full if n is None else min(n, full)
        rp = ladder_cells.row_prior(grid, prior, self.pooled_weight)
        stats = ladder_cells.gather(table, table.total, slice(None), ladder_cells.gathered(grid, n), n == full, rp)
        return ladder_cells.hazards(grid, stats, n).T

    def plan(self, history: IdleHistory, prior: PooledPrior | None = None,
             zygote_others: float | None = None) -> IdlePlan:
        """The plan of one history; `zygote_others` as in `plans` (None: the zygote split evenly)."""
        others = None if zygote_others is None else np.array([zygote_others])
        return self.plans(history.table(), zygote_others=others, prior=prior).row(0)

    def _prior_excess_s(self) -> float:
        """Mean idle time beyond the range under the prior (log-uniform: E[t | t > R] = (hi - R) / ln(hi / R))."""
        r, hi = self.range_s, self.prior_max_s
        return float((hi - r) / np.log(hi / r) - r) if hi > r * (1 + 1e-9) else self.bin_s

    def plans(self, table: HistoryTable, need_s: np.ndarray | None = None,
              zygote_others: np.ndarray | None = None, prior: PooledPrior | None = None) -> PlanTable:
        """Plans per row; with `need_s`, row i's plan is only exact up to need_s[i] idle seconds.

        The simulator passes the longest idle period each plan will meet, which lets a busy
        application's plans (all idle periods under a minute) cost the head cells instead of 250.
        `zygote_others` (per row) is the share of time some other model of the runtime has been seen
        holding the zygote (the simulator's first pass, `ember.sim.batched`; live, `ember.keepalive.zygote_share`):
        the zygote is then priced at its marginal cost (`zygote_price`). `prior` (one per
        row) is the pooled prior the driver has learnt from all its applications (`pooled_weight` of it is mixed
        into the log-uniform prior; unused at `pooled_weight` 0).
        """
        grid = self.grid(table.spec)
        full = len(grid.starts)
        zprice = self.zygote_price(zygote_others)     # a float, or one per row
        groups = [(np.arange(table.rows), full)]
        if need_s is not None:
            need = np.searchsorted(grid.starts, np.maximum(need_s, 0.0), side="right")   # cells up to need_s's
            groups, lo = [], 0
            for cap in (grid.heads, grid.heads + 3, grid.heads + 15, grid.heads + 63, full):
                cap = min(cap, full)
                rows = np.flatnonzero((need > lo) & (need <= cap))
                if len(rows):
                    groups.append((rows, cap))
                lo = cap
                if cap >= full:
                    break
        per_start = self.start_value(table) if self.cold_per_app else None
        return PlanTable(*ladder_cells.plan_table(grid, table, groups, zprice, per_start,
                                                  ladder_cells.row_prior(grid, prior, self.pooled_weight)))

    def repriced(self, table: HistoryTable, need_s: np.ndarray, plans: PlanTable, before: np.ndarray | None,
                 after: np.ndarray, prior: PooledPrior | None = None) -> PlanTable:
        """`plans(table, need_s, after)`, given `plans` = `plans(table, need_s, before)`: only the rows whose plan
        can change (`to_replan`) are planned again."""
        redo = self.to_replan(plans, before, after)
        if not len(redo):
            return plans
        keep = np.setdiff1d(np.arange(table.rows), redo)
        again = self.plans(table.take(redo), need_s[redo], after[redo], prior and prior.take(redo))
        return PlanTable.merge(table.rows, [(keep, PlanTable(plans.breaks[keep], plans.codes[keep])), (redo, again)])

    def to_replan(self, plans: PlanTable, before: np.ndarray | None, after: np.ndarray | None) -> np.ndarray:
        """The rows of `plans` (made at zygote share `before`) whose plan can change at `after` (None: the even
        split).

        The zygote's price is added to every level but FETCH for the same time held, so it never reorders the
        levels that hold it: a cheaper zygote can only turn FETCH cells into others (rows without FETCH keep
        their plan), a dearer one can turn any cell into FETCH."""
        rows = len(plans.breaks)
        old = np.broadcast_to(self.zygote_price(before), (rows,))
        new = np.broadcast_to(self.zygote_price(after), (rows,))
        fetch = ((plans.codes == COLD) & np.isfinite(plans.breaks)).any(axis=1)
        return np.flatnonzero((new > old * (1 + 1e-12)) | ((new < old) & fetch))

    def replans(self, plan: IdlePlan, before: float | None, after: float | None) -> bool:
        """Whether `plan`, made at zygote share `before`, can change at share `after` (`to_replan` of one row)."""
        def row(share: float | None) -> np.ndarray | None:
            return None if share is None else np.array([share])
        return len(self.to_replan(PlanTable.of(plan), row(before), row(after))) > 0

    def prices_zygote_share(self) -> bool:
        return self.marginal_zygote

    def with_memory_copy(self, memory_copy_mb: float) -> LadderPolicy:
        """A store-backed model's copy in the memory tier priced on the zygote rung (the rungs above map it, FETCH
        releases it)."""
        return replace(self, costs=replace(self.costs, memory_copy_mb=memory_copy_mb))

    def held_head(self, table: HistoryTable, prior: PooledPrior | None = None) -> np.ndarray:
        """(m, h): expected seconds held in each head cell [a, b) given idle at a, E[min(idle, b) - a | idle >= a],
        from the periods seen there (prior-smoothed); see `ember.keepalive.ladder_cells.held_head`.

        A busy model's idle periods are far shorter than a minute; charging it a whole cell would
        overstate what keeping it hot costs.
        """
        grid = self.grid(table.spec)
        rp = ladder_cells.row_prior(grid, prior, self.pooled_weight)
        return ladder_cells.held_head(grid, ladder_cells.gather(table, table.total, slice(None), 1, False, rp)).T

    def candidates(self) -> np.ndarray:
        """Allowed levels not dominated by another (no more memory and no dearer a start; ties go to the
        cheaper-to-start)."""
        # With a cold value, a start needing a new process is dearer than one that does not, at any latency.
        mb, lat = self.level_mb(), self.costs.start_s() + (NEW_PROCESS if self.cold_value > 0 else 0.0)
        allowed = [i for i, lv in enumerate(LEVELS) if lv in self.rungs]

        def beaten(j: int, i: int) -> bool:
            return i != j and mb[i] <= mb[j] and lat[i] <= lat[j] and (mb[i] < mb[j] or lat[i] < lat[j] or i < j)

        return np.array([j for j in allowed if not any(beaten(j, i) for i in allowed)])

    def sweep(self) -> tuple[float, ...]:
        # Up to 1e9: on a day of many rare applications the baselines' most generous points (hybrid's 4-hour
        # default) hold ~2.5M GB*s, which the ladder only reaches above 1e7 ("The first fix",
        # cf56f52^:docs/evaluation-log.md).
        return tuple(float(v) for v in np.logspace(2, 9, 29))


@dataclass(frozen=True)
class LadderCold(LadderPolicy):
    """The ladder minimising idle memory plus valued cold starts (the ATC'20 objective): its knob is
    `cold_value`, MB*s per start that needs a new process; start latency is not valued by default
    (`latency_value` 0), so a zygote start costs what a full fetch does and the plans keep a model hot or
    nothing, except where the zygote is up anyway (its marginal price 0: the zygote rung is then free)."""

    name: ClassVar[str] = "ladder-cold"
    knob: ClassVar[str] = "cold_value"
    latency_value: float = 0.0
    cold_value: float = 1e8
    cold_per_app: bool = True

    def sweep(self) -> tuple[float, ...]:
        # Per app, a start moves a busy app's share of a day by ~1e-5 (idle ~1 s) and a rare one's by ~0.1 (a few
        # hours): 1e3 to 1e12, 37 points (x1.78 apart), spans both ends of the frontier on every trace here.
        return tuple(float(v) for v in np.logspace(3, 12, 37))


@functools.lru_cache(maxsize=256)
def _grid(policy: LadderPolicy, head: HistogramSpec) -> Grid:
    return policy._grid(head)


POLICIES: dict[str, type[PolicyBase]] = {"fixed": FixedKeepAlive, "fixed-zygote": FixedZygote,
                                         "hybrid": HybridHistogram, "hybrid-zygote": HybridZygote,
                                         "ladder": LadderPolicy, "ladder-cold": LadderCold}


def make_policy(name: str, **knobs: Any) -> KeepAlivePolicy:
    """A policy by name with keyword knobs; unknown names or knobs raise InvalidInput naming them."""
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidInput(f"unknown keep-alive policy {name!r} (known: {', '.join(POLICIES)})")
    try:
        policy: KeepAlivePolicy = cls(**knobs)  # type: ignore[assignment]
        return policy
    except TypeError as err:
        raise InvalidInput(f"{name}: {err}") from None
