"""The discrete-event keep-alive simulator, vectorised per application.

Per application, as in "Serverless in the Wild": one instance (or its idle capacity) per
application; each execution is followed by an idle period, the time to the next arrival
minus the execution time, during which the policy's plan decides the rung. The next
request starts from the rung the plan holds at its idle time; an arrival while the
previous execution still runs finds the instance hot.

Events are processed per application with numpy: idle periods are items (idle seconds,
how many identical periods, refresh segment). Plans refresh at each of an application's
first 64 arrivals and then once per simulated minute with arrivals (the policy's view
then holds every idle period that ended before the refresh), which for rare
applications is every invocation; the trailing idle period after an application's last execution gets a refresh
of its own, with every period seen.
Everything is deterministic: the only randomness is in the trace (seeded).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ember.core.rung_costs import RungCosts
from ember.keepalive.forecast import HistoryTable
from ember.keepalive.idle_plan import COLD, HOT, LEVELS, ZYGOTE, KeepAlivePolicy, PlanTable
from ember.keepalive.policies import LadderPolicy
from ember.sim.batched import BATCH_APPS, Priors, Run, fetch_climbs, holdings, ladder_runs
from ember.sim.pooled import trace_priors
from ember.sim.traces import AppTrace, Trace
from ember.sim.zygotes import Holding, starts_up, union_s

REFRESH_S = 60.0
# The first arrivals of an application each refresh its plan: a new, busy application must not
# spend its first minute on the plan made from no history at all.
REFRESH_EACH_FIRST = 64
_N = len(LEVELS)


@dataclass
class AppItems:
    """One application's idle periods in order."""

    gaps: np.ndarray       # idle seconds (negative: the next arrival came while executing)
    weights: np.ndarray    # identical periods each item stands for
    segs: np.ndarray       # refresh segment in which each period began
    n_segs: int
    trailing_gap: float    # idle from the last execution to the end of the trace (memory only)
    invocations: int
    at: np.ndarray = field(default_factory=lambda: np.zeros(0))      # when each item's (first) idle period begins
    every: np.ndarray = field(default_factory=lambda: np.zeros(0))   # a repeated item's period spacing (else 0)
    seg_t: np.ndarray = field(default_factory=lambda: np.zeros(0))   # when each refresh segment's plan is made
    first_s: float = 0.0                                             # the first arrival
    trailing_at: float = 0.0                                         # when the trailing idle period begins


def app_items(app: AppTrace, horizon_s: float) -> AppItems:
    """Each group's idle periods as four items: within-group gaps while an earlier, longer execution still
    runs (busy), the one gap it then leaves (partial), the regular ones (spacing less duration), and the gap to
    the next group. Idle time always runs from the latest end of any execution so far, not from the end of the
    last arrival (an arrival during any execution finds the instance busy)."""
    k, t, s, d = app.counts, app.starts, app.spacing, app.durations
    g = len(t)
    if g and (k == 1).all():
        return _single_items(app, horizon_s)
    latest, busy, partial, partial_gap = group_spans(app)
    gaps = np.empty(4 * g)
    weights = np.empty(4 * g, dtype=np.int64)
    gaps[0::4], weights[0::4] = -1.0, busy
    gaps[1::4], weights[1::4] = partial_gap, partial
    gaps[2::4], weights[2::4] = s - d, k - 1 - busy - partial
    gaps[3::4], weights[3::4] = np.append(t[1:] - latest[:-1], 0.0), 1
    weights[-1:] = 0                                  # no arrival after the last group (an app may have none)
    # When each item's idle period begins (a regular item: its first; the others follow `s` apart).
    at, every = np.zeros(4 * g), np.zeros(4 * g)
    at[1::4] = t + np.maximum(busy + partial, 0) * s - partial_gap
    first_regular = np.where(partial > 0, busy + 2, np.maximum(busy + 1, 1))
    at[2::4], every[2::4] = t + (first_regular - 1) * s + d, s
    at[3::4] = latest
    first_idx, seg = _segments(t)
    segs = np.repeat(seg, 4)
    keep = weights > 0
    return AppItems(gaps[keep], weights[keep], segs[keep], int(seg[-1]) + 2 if g else 0,
                    max(0.0, horizon_s - float(latest[-1])) if g else 0.0, int(k.sum()),
                    at[keep], every[keep], _trailing_refresh(t[first_idx], latest, g), float(t[0]) if g else 0.0,
                    float(latest[-1]) if g else 0.0)


def _single_items(app: AppTrace, horizon_s: float) -> AppItems:
    """`app_items` where every group is one arrival (a per-invocation trace): then no arrival of a group follows
    another of it, and each group's only item is the gap to the next group (the same items, found directly)."""
    k, t, s, d = app.counts, app.starts, app.spacing, app.durations
    latest = np.maximum.accumulate(t + (k - 1) * s + d)          # as group_spans: the latest end through each
    first_idx, seg = _segments(t)
    return AppItems(t[1:] - latest[:-1], np.ones(len(t) - 1, dtype=np.int64), seg[:-1], int(seg[-1]) + 2,
                    max(0.0, horizon_s - float(latest[-1])), int(k.sum()), latest[:-1], np.zeros(len(t) - 1),
                    _trailing_refresh(t[first_idx], latest, len(t)), float(t[0]), float(latest[-1]))


def _trailing_refresh(seg_t: np.ndarray, latest: np.ndarray, groups: int) -> np.ndarray:
    """The refresh points, and one more for the trailing idle period, at the end of the last execution: the live
    node plans every idle period from all it has seen (`ember.serving.requests` drops the plan at each arrival), and
    the trailing one, the rest of the trace, must not run on the plan made before the last segment's periods (an
    application whose day is one minute's burst ran its whole day on the plan of no history)."""
    return np.append(seg_t, latest[-1]) if groups else seg_t


def _segments(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first group of each refresh segment, and each group's segment (`refresh_keys` are non-decreasing)."""
    keys = refresh_keys(t)
    new = np.ones(len(keys), dtype=bool)
    np.not_equal(keys[1:], keys[:-1], out=new[1:])
    return np.flatnonzero(new), np.cumsum(new) - 1


def group_spans(app: AppTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per group: the latest end of any execution through it; how many of its arrivals after the first come
    while an earlier execution still runs (busy); whether one arrival then follows the end of that execution
    (partial, 0 or 1) and the idle gap before it."""
    k, t, s, d = app.counts, app.starts, app.spacing, app.durations
    latest = np.maximum.accumulate(t + (k - 1) * s + d)          # the latest end through each group
    before = np.append(-np.inf, latest[:-1])                     # ... through the groups before it
    with np.errstate(divide="ignore", invalid="ignore"):
        covered = np.where(s > 0, np.ceil((before - t) / np.where(s > 0, s, 1.0)), np.where(before > t, k, 0))
    m = np.clip(covered, 0, k).astype(np.int64)                   # arrivals that start while it still runs
    busy = np.maximum(m - 1, 0)
    partial = ((m >= 1) & (m < k)).astype(np.int64)
    partial_gap = t + m * s - np.maximum(before, t + (m - 1) * s + d)
    return latest, busy, partial, partial_gap


def refresh_keys(starts: np.ndarray) -> np.ndarray:
    """Non-decreasing keys, equal for groups that share a plan: each of the first groups alone, then per minute."""
    keys = np.floor(starts / REFRESH_S)
    first = min(REFRESH_EACH_FIRST, len(starts))
    keys[:first] = starts[:first] / REFRESH_S
    return np.maximum.accumulate(keys)


@dataclass
class RunResult:
    """One policy (at one knob value) over one trace."""

    policy: str
    knob: str
    knob_value: float
    invocations: int = 0
    starts: np.ndarray = field(default_factory=lambda: np.zeros(_N))        # starts per level
    idle_s: np.ndarray = field(default_factory=lambda: np.zeros(_N))        # idle seconds per level
    idle_mb_s: np.ndarray = field(default_factory=lambda: np.zeros(_N))     # idle MB*s per level
    shared_mb_s: float = 0.0      # zygotes (shared per runtime): the union of the times its models hold it
    wall_s: float = 0.0
    over_budget: int = 0          # shared engine: starts that found the node full of busy instances (ran anyway)
    prewarms: int = 0             # lp-buffer: evicted instances the planner loaded back from the zygote
    plans: int = 0                # lp-buffer: plans made, and those where the budget bound (the LP was solved)
    lp_solves: int = 0
    app_cold: np.ndarray = field(default_factory=lambda: np.zeros(0))   # per app: share of cold starts
    # With `simulate(..., per_app=True)`: per index into the trace's apps (those with arrivals), its starts and
    # idle seconds per level and its hold on its runtime's zygote.
    apps: dict[int, Run] = field(default_factory=dict)

    @property
    def app_cold_p75(self) -> float:
        """The third quartile over applications of their cold-start share (the ATC 2020 paper's metric)."""
        return float(np.percentile(self.app_cold, 75)) if len(self.app_cold) else 0.0

    @property
    def total_idle_mb_s(self) -> float:
        return float(self.idle_mb_s.sum() + self.shared_mb_s)

    @property
    def cold_start_rate(self) -> float:
        """Share of starts that needed a new process (template, zygote or nothing)."""
        return float(self.starts[2:].sum() / max(1, self.invocations))

    def latency_quantile(self, costs: RungCosts, q: float) -> float:
        lat = costs.start_s()
        order = np.argsort(lat)
        cum = np.cumsum(self.starts[order])
        if cum[-1] <= 0:
            return 0.0
        return float(lat[order][np.searchsorted(cum, q * cum[-1] - 1e-9)])

    def latency_mean(self, costs: RungCosts) -> float:
        return float(self.starts @ costs.start_s() / max(1, self.invocations))


def evaluate(plans: PlanTable, items: AppItems,
             start_s: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Starts per level and idle seconds per level for one app; also the first arrival's level.

    The first arrival is a compulsory cold start (nothing of the application exists before it, and nothing is
    charged for memory before it), whatever the empty-history plan would hold: every policy pays it alike."""
    starts, idle, first, _ = evaluate_held(plans, items, start_s)
    return starts, idle, first


def evaluate_held(plans: PlanTable, items: AppItems,
                  start_s: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int, Holding]:
    """`evaluate`, and the app's hold on its runtime's zygote (its FETCH intervals, see `ember.sim.zygotes`).

    `start_s` (per level): a period that ends while its plan is still climbing to a warmer rung starts from the
    rung it climbs from (`IdlePlan.start_rung`); None: climbs take no time."""
    breaks, codes = plans.breaks, plans.codes
    k = breaks.shape[1]
    first = COLD
    gaps = np.append(items.gaps, items.trailing_gap)
    w = np.append(items.weights, 1).astype(np.float64)
    segs = np.append(items.segs, max(0, items.n_segs - 1))
    busy = gaps < 0
    g = np.maximum(gaps, 0.0)
    idle_w = np.where(busy, 0.0, w)                                     # a busy instance is not idle
    idle = np.zeros(_N)
    tail = np.zeros(_N)                                                 # the trailing period's, per level
    level = np.zeros(len(g), dtype=np.int64)
    fetch: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []        # (item, from, to) on FETCH, relative
    fetch_steps = ((codes == COLD) & np.isfinite(breaks)).any(axis=0)
    arrives = ~busy
    arrives[-1] = False                                                  # the trailing period: no arrival ends it
    # Step by step (plans have a few): the time each period spends in step j, and the step it ends in.
    begin = breaks[segs, 0]
    last = np.zeros(len(g), dtype=np.int64)             # the step each period ends in
    for j in range(k):
        end = breaks[segs, j + 1] if j + 1 < k else np.full(len(g), np.inf)
        reached = g >= begin
        code = codes[segs, j]
        with np.errstate(invalid="ignore"):
            upto = np.minimum(g, end)
            held = np.where(reached, upto - begin, 0.0)
        idle += np.bincount(code, weights=idle_w * held, minlength=_N)
        tail[code[-1]] += held[-1]
        level = np.where(reached, code, level)
        last = np.where(reached, j, last)
        if fetch_steps[j]:                                               # (most plans' steps are not FETCH)
            on_fetch = np.flatnonzero((code == COLD) & (held > 0) & ~busy)
            if len(on_fetch):
                fetch.append((on_fetch, begin[on_fetch], upto[on_fetch]))
        begin = end
    level = np.where(busy, HOT, plans.start_levels(segs, last, g, start_s))
    starts = np.bincount(level[:-1], weights=w[:-1], minlength=_N)
    starts[first] += 1
    cold = (level == COLD) & arrives                                    # periods an arrival ends on FETCH
    idx, lo, hi = ((np.concatenate(x) for x in zip(*fetch, strict=True)) if fetch
                   else (np.zeros(0, np.int64), np.zeros(0), np.zeros(0)))
    hold = holdings([items], (idx, lo, hi, cold[idx] & (hi >= g[idx])), w, np.zeros(len(g), np.int64), cold, g,
                    fetch_climbs(plans, segs, last, g, cold, start_s))[0]
    hold.tail_s = tail
    return starts, idle, first, hold


def _need(items: AppItems) -> np.ndarray:
    """The longest idle period each refresh segment's plan meets (the first plan: forever, for the first arrival)."""
    need = np.zeros(max(1, items.n_segs))
    np.maximum.at(need, items.segs, items.gaps)
    need[max(0, items.n_segs - 1)] = max(need[max(0, items.n_segs - 1)], items.trailing_gap)
    need[0] = np.inf
    return need


def simulate(trace: Trace, policy: KeepAlivePolicy, costs: RungCosts, *, runtimes: int = 1,
             items: list[AppItems] | None = None, batch_apps: int | None = None, per_app: bool = False,
             ready_s: float | None = None) -> RunResult:
    """Run `policy` over every application of `trace`; app i's model is on runtime i mod `runtimes`, whose zygote
    is charged for the union of the times its models hold it (`ember.sim.zygotes`). `per_app`: keep each
    application's own figures and hold in `RunResult.apps` (for a replay comparing model by model).

    A start from "nothing kept" that finds the zygote up, the other models of its runtime having held it through
    the `ready_s` before (by default a full start's time: one they were making is not ready yet), is a zygote
    start, as on the live node (`ember.sim.zygotes.found_up`); an application's first start stays a full one.

    A ladder pricing the zygote at its marginal cost is run twice: the first pass (the zygote split evenly
    between the models sharing it) gives each model's hold on the zygote per minute; each plan of the second
    is made knowing the share of the past hour in which the other models of its runtime held it in the first
    (only the past: what a live driver would have seen)."""
    began = time.perf_counter()
    all_items = items if items is not None else [app_items(a, trace.horizon_s) for a in trace.apps]
    runtime_of = np.arange(len(all_items)) % runtimes
    active = [i for i, it in enumerate(all_items) if it.invocations > 0]
    if isinstance(policy, LadderPolicy):
        runs = ladder_runs(policy, [all_items[i] for i in active], runtime_of[active], trace.horizon_s,
                           marginal=_marginal(policy, runtime_of[active]), batch_apps=batch_apps or BATCH_APPS,
                           priors=_priors(policy, all_items, active, trace.horizon_s), start_s=costs.start_s())
    else:
        runs = [_run(policy, all_items[i], costs.start_s()) for i in active]
    runs = _found_up(runs, runtime_of[active], costs.cold.start_s if ready_s is None else ready_s)
    result = RunResult(policy.name, policy.knob, policy.knob_value())
    holdings: list[list[Holding]] = [[] for _ in range(runtimes)]
    for i, (starts, idle, hold) in zip(active, runs, strict=True):
        result.invocations += all_items[i].invocations
        result.starts += starts
        result.idle_s += idle
        holdings[runtime_of[i]].append(hold)
        if per_app:
            result.apps[i] = (starts, idle, hold)
    result.app_cold = np.array([r[0][2:].sum() / all_items[i].invocations for i, r in zip(active, runs, strict=True)])
    result.idle_mb_s = result.idle_s * costs.own_mb()
    result.shared_mb_s = sum(union_s(h, trace.horizon_s) for h in holdings) * costs.zygote.idle_mb
    result.wall_s = time.perf_counter() - began
    return result


def _found_up(runs: list[Run], runtime_of: np.ndarray, ready_s: float) -> list[Run]:
    """`runs` with each start from FETCH that found its runtime's zygote up counted as a zygote start, and each that
    came during a climb back from FETCH begun while the zygote was up as a start from what the climb reached."""
    out = list(runs)
    for r in np.unique(runtime_of):
        apps = np.flatnonzero(runtime_of == r)
        holds = [runs[i][2] for i in apps]
        moved, climbed = starts_up(holds, ready_s, _N)
        for i, n, c in zip(apps, moved, climbed, strict=True):
            if n or c.any():
                starts = runs[i][0].copy()
                starts[COLD] -= n
                starts[ZYGOTE] += n - c.sum()
                starts += c
                out[i] = (starts, runs[i][1], runs[i][2])
    return out


def _run(policy: KeepAlivePolicy, it: AppItems, start_s: np.ndarray | None = None) -> Run:
    """One application planned from its own statistics and evaluated against its arrivals."""
    table = HistoryTable.build(policy.new_history().spec, np.maximum(it.gaps, 0.0), it.weights, it.segs,
                               max(1, it.n_segs))
    starts, idle, _, hold = evaluate_held(policy.plans(table, need_s=_need(it)), it, start_s)
    return starts, idle, hold


def _priors(policy: LadderPolicy, all_items: list[AppItems], active: list[int], horizon_s: float) -> Priors:
    """A ladder mixing in the pooled prior: the epochs' priors and, per active app, its refresh points' prior
    indices (`ember.sim.pooled`); None otherwise (the log-uniform prior alone)."""
    if policy.pooled_weight <= 0 or not active:
        return None
    base, index = trace_priors(policy, all_items, active, horizon_s)
    return base, [index[i] for i in active]


def _marginal(policy: KeepAlivePolicy, runtime_of: np.ndarray) -> bool:
    """Whether the policy prices the zygote at its marginal cost and some runtime has more than one model."""
    return policy.prices_zygote_share() and len(runtime_of) > len(np.unique(runtime_of))


def poisson_trace(rate_per_s: float, horizon_s: float, *, seed: int = 0, apps: int = 1,
                  duration_s: float = 0.0) -> Trace:
    """Independent Poisson arrivals per app (one arrival per group): for closed-form checks and benchmarks."""
    rng = np.random.default_rng(seed)
    out = []
    for a in range(apps):
        n = rng.poisson(rate_per_s * horizon_s)
        t = np.sort(rng.random(n) * horizon_s)
        out.append(AppTrace(f"poisson-{a}", t, np.ones(n, dtype=np.int64), np.zeros(n), np.full(n, duration_s)))
    return Trace(f"poisson-{rate_per_s:g}/s", "poisson", horizon_s, out)


__all__ = ["COLD", "AppItems", "RunResult", "app_items", "evaluate", "evaluate_held", "group_spans", "poisson_trace",
           "simulate"]
