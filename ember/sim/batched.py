"""The ladder's passes over a trace, many applications at a time.

The per-application engine (`ember.sim.engine.evaluate_held`) costs a few dozen numpy calls per
application whatever its size; a day of a thousand rare applications is then mostly call overhead. A
ladder's plans depend on each row's statistics alone, so here a batch of applications is one history
table (`HistoryTable.build_many`), one `plans` call and one evaluation: the batch's items are laid end
to end (each application's rows of the plan table follow the previous one's) and every sum is kept per
(application, level), so each application's figures are the very floats `evaluate_held` gives it, added
up in the same order. The second pass of the marginal zygote price (see `ember.sim.engine.simulate`)
replans only the rows whose plan can change (`LadderPolicy.to_replan`), rebuilding an application's
statistics only then. A ladder mixing in the pooled prior (`ember.sim.pooled`) gets each plan's prior row by
row, end to end as the plans are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ember.keepalive.forecast import HistogramSpec, HistoryTable
from ember.keepalive.idle_plan import COLD, HOT, LEVELS, ZYGOTE, PlanTable
from ember.keepalive.policies import LadderPolicy
from ember.keepalive.pooled_prior import PooledPrior
from ember.keepalive.zygote_share import WINDOW_S
from ember.sim.zygotes import Holding, fetch_intervals, held_per_minute_many, others_share, trailing_means

if TYPE_CHECKING:
    from ember.sim.engine import AppItems

_N = len(LEVELS)
Run = tuple[np.ndarray, np.ndarray, Holding]
# A pooled prior's epochs (with no rows) and, per application, the prior of each of its plans (`ember.sim.pooled`).
Priors = tuple[PooledPrior, list[np.ndarray]] | None

# Applications planned and evaluated together: numpy's per-call cost is paid per batch, not per application,
# while the batch's histograms (rows x statistics) stay a few tens of MB.
BATCH_APPS = 32
# The window over which the share of time others held a runtime's zygote is observed (marginal zygote pricing):
# the live server's (`ember.keepalive.zygote_share`).
OTHERS_WINDOW_S = WINDOW_S


@dataclass
class _Batch:
    """One batch's first pass: its applications, their plans end to end, and what they gave."""

    items: list[AppItems]
    first_row: np.ndarray     # (apps + 1,) where each application's rows begin (and the end)
    need: np.ndarray          # (rows,) the longest idle period each plan meets
    plans: PlanTable
    runs: list[Run]
    prior: PooledPrior | None  # per row, where the ladder mixes in a pooled prior


def ladder_runs(policy: LadderPolicy, items: list[AppItems], runtime_of: np.ndarray, horizon_s: float, *,
                marginal: bool, batch_apps: int = BATCH_APPS, priors: Priors = None,
                start_s: np.ndarray | None = None) -> list[Run]:
    """Each application's run under `policy` (`runtime_of` its runtime); with `marginal`, the second pass at the
    zygote's marginal price. `priors`: the pooled prior of each application's plans (None: none). `start_s`: per
    level, as in `ember.sim.engine.evaluate_held`."""
    spec = policy.new_history().spec
    batches = [_first_pass(policy, spec, items[lo:lo + batch_apps], _rows_prior(priors, lo, lo + batch_apps),
                           start_s) for lo in range(0, len(items), batch_apps)]
    runs = [r for b in batches for r in b.runs]
    if not marginal:
        return runs
    others = _others(runs, items, runtime_of, horizon_s, policy)
    out: list[Run] = []
    for b in batches:
        out += _second_pass(policy, spec, b, others[len(out):len(out) + len(b.items)], start_s)
    return out


def _rows_prior(priors: Priors, lo: int, hi: int) -> PooledPrior | None:
    """The pooled prior of the plans of applications lo to hi, end to end."""
    return None if priors is None else priors[0].rows_for(np.concatenate(priors[1][lo:hi]))


def _first_pass(policy: LadderPolicy, spec: HistogramSpec, batch: list[AppItems],
                prior: PooledPrior | None = None, start_s: np.ndarray | None = None) -> _Batch:
    rows = [max(1, it.n_segs) for it in batch]
    table = HistoryTable.build_many(spec, [(np.maximum(it.gaps, 0.0), it.weights, it.segs, r)
                                           for it, r in zip(batch, rows, strict=True)])
    need = needs(batch, rows)
    plans = policy.plans(table, need_s=need, prior=prior)
    return _Batch(batch, np.concatenate([[0], np.cumsum(rows)]), need, plans,
                  evaluate_many(plans, batch, rows, start_s), prior)


def _second_pass(policy: LadderPolicy, spec: HistogramSpec, b: _Batch, others: list[np.ndarray],
                 start_s: np.ndarray | None = None) -> list[Run]:
    """The batch's runs with each plan made at the zygote's marginal price (`others`: per application, per
    plan); only the applications with a plan that can change are planned and evaluated again."""
    after = np.concatenate(others)
    redo = policy.to_replan(b.plans, None, after)
    runs = list(b.runs)
    for j in np.unique(np.searchsorted(b.first_row, redo, side="right") - 1):
        it, lo, hi = b.items[j], b.first_row[j], b.first_row[j + 1]
        table = HistoryTable.build(spec, np.maximum(it.gaps, 0.0), it.weights, it.segs, max(1, it.n_segs))
        prior = None if b.prior is None else b.prior.take(np.arange(lo, hi))
        plans = policy.repriced(table, b.need[lo:hi], PlanTable(b.plans.breaks[lo:hi], b.plans.codes[lo:hi]), None,
                                after[lo:hi], prior)
        runs[j] = evaluate_many(plans, [it], [hi - lo], start_s)[0]
    return runs


def _others(runs: list[Run], items: list[AppItems], runtime_of: np.ndarray, horizon_s: float,
            policy: LadderPolicy) -> list[np.ndarray]:
    """Per application, per refresh segment: the share of the past hour some other model of its runtime held the
    zygote (the first pass); before a whole minute has passed, the even split's share."""
    held = held_per_minute_many([r[2] for r in runs], horizon_s)
    prior = 1.0 - 1.0 / max(1.0, float(policy.zygote_share))
    out: list[np.ndarray] = [np.zeros(0)] * len(items)
    for r in np.unique(runtime_of):
        apps = np.flatnonzero(runtime_of == r)
        seg_t = [items[i].seg_t for i in apps]
        row = np.repeat(np.arange(len(apps)), [len(t) for t in seg_t])
        shares = trailing_means(others_share(held[apps]), row, np.concatenate(seg_t), OTHERS_WINDOW_S, prior)
        cut = np.concatenate([[0], np.cumsum([len(t) for t in seg_t])])
        for n, i in enumerate(apps):
            out[i] = shares[cut[n]:cut[n + 1]]
    return out


def _items(batch: Sequence[AppItems], rows: Sequence[int]) -> tuple[np.ndarray, ...]:
    """Every application's items then its trailing idle period, end to end: (gaps, weights, plan row, app)."""
    first_row = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
    gaps: list[Any] = []
    weights: list[Any] = []
    segs: list[Any] = []
    for it in batch:
        gaps += [it.gaps, [it.trailing_gap]]
        weights += [it.weights, [1]]
        segs += [it.segs, [max(0, it.n_segs - 1)]]
    sizes = np.array([len(it.gaps) + 1 for it in batch])
    app = np.repeat(np.arange(len(batch)), sizes)
    return (np.concatenate(gaps), np.concatenate(weights).astype(np.float64),
            np.concatenate(segs).astype(np.int64) + first_row[app], app, np.cumsum(sizes) - 1)


def needs(batch: Sequence[AppItems], rows: Sequence[int]) -> np.ndarray:
    """`ember.sim.engine._need` of each application of `batch`, end to end (`rows` plans each)."""
    first_row = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
    need = np.zeros(int(np.sum(rows)))
    app = np.repeat(np.arange(len(batch)), [len(it.gaps) for it in batch])
    segs = np.concatenate([it.segs for it in batch]).astype(np.int64) + first_row[app]
    np.maximum.at(need, segs, np.concatenate([it.gaps for it in batch]))
    last = first_row + np.array([max(0, it.n_segs - 1) for it in batch])
    need[last] = np.maximum(need[last], [it.trailing_gap for it in batch])
    need[first_row] = np.inf
    return need


def evaluate_many(plans: PlanTable, batch: Sequence[AppItems], rows: Sequence[int],
                  start_s: np.ndarray | None = None) -> list[Run]:
    """`ember.sim.engine.evaluate_held` of each application of `batch`, whose plans are `rows` rows each of
    `plans`, end to end: per application, starts and idle seconds per level, and its hold on the zygote.

    Every step of every item's plan at once: one entry per (item, step of its plan), item by item. (A batch's
    plans are as wide as its widest; most have a step or two.) A step begins at `begin` and ends where the next
    begins; a period of g idle seconds holds it for min(g, end) - begin if g >= begin."""
    gaps, w, segs, app, last = _items(batch, rows)
    a, n = len(batch), len(gaps)
    width = plans.breaks.shape[1]
    finite = np.isfinite(plans.breaks)
    steps = finite[:, 0].astype(np.int64)                               # each plan's steps (a column at a time:
    for j in range(1, width):                                           # ~10x a sum along the short axis)
        steps += finite[:, j]
    steps = steps[segs]                                                 # ... each item's plan's
    first = np.concatenate([[0], np.cumsum(steps)[:-1]])                # each item's first entry

    def each(x: np.ndarray) -> np.ndarray:                              # per item -> per entry
        return np.repeat(x, steps)

    step = np.arange(int(first[-1] + steps[-1]) if n else 0) - each(first)
    # A step ends where the next begins: with a column of +inf after the last, the next entry of the flat table.
    padded = np.full((len(plans.breaks), width + 1), np.inf)
    padded[:, :width] = plans.breaks
    at = each(segs * (width + 1)) + step
    begin = padded.ravel()[at]
    end = padded.ravel()[at + 1]
    code = plans.codes.ravel()[at - each(segs)].astype(np.int64)
    busy = gaps < 0
    g = each(np.maximum(gaps, 0.0))
    reached = g >= begin
    upto = np.minimum(g, end)
    held = np.where(reached, upto - begin, 0.0)
    idle_w = np.where(busy, 0.0, w)                                     # a busy instance is not idle
    # Per (step, application, level), the items' idle seconds in order; then the steps one after the other.
    per_step = np.bincount((step * a + each(app)) * _N + code, weights=each(idle_w) * held,
                           minlength=width * a * _N).reshape(width, a * _N)
    idle = np.zeros(a * _N)
    for j in range(width):
        idle += per_step[j]
    trailing = np.zeros(n, dtype=bool)
    trailing[last] = True
    tail = np.bincount(each(app) * _N + code, weights=np.where(each(trailing), held, 0.0),
                       minlength=a * _N).reshape(a, _N)
    # The level a period ends on: its last step begun (each plan begins at 0, so every period begins one).
    ended = np.maximum.reduceat(np.where(reached, step, -1), first)
    level = np.where(busy, HOT, plans.start_levels(segs, ended, np.maximum(gaps, 0.0), start_s))
    counted = w.copy()
    counted[last] = 0.0                       # the trailing period: no arrival ends it (whole numbers: sums exact)
    starts = np.bincount(app * _N + level, weights=counted, minlength=a * _N).reshape(a, _N)
    starts[:, COLD] += 1                                                # each first arrival: nothing existed
    on_fetch = np.flatnonzero((code == COLD) & (held > 0) & ~each(busy))
    on_fetch = on_fetch[np.argsort(step[on_fetch], kind="stable")]     # step by step, as evaluate_held lists them
    item = np.searchsorted(first, on_fetch, side="right") - 1
    cold = (level == COLD) & (counted > 0)                              # periods an arrival ends on FETCH
    ends = cold[item] & (upto[on_fetch] >= g[on_fetch])
    climb = fetch_climbs(plans, segs, ended, np.maximum(gaps, 0.0), cold, start_s)
    holds = holdings(batch, (item, begin[on_fetch], upto[on_fetch], ends), w, app, cold, np.maximum(gaps, 0.0),
                     climb)
    per_level = idle.reshape(a, _N)
    for i in range(a):
        holds[i].tail_s = tail[i]
    return [(starts[i], per_level[i], holds[i]) for i in range(a)]


def fetch_climbs(plans: PlanTable, segs: np.ndarray, step: np.ndarray, gaps: np.ndarray, cold: np.ndarray,
                 start_s: np.ndarray | None) -> tuple[np.ndarray, ...] | None:
    """The periods (of `segs`, ended in `step` after `gaps`) an arrival ends on FETCH (`cold`) while their plan
    climbs back from it, with `PlanTable.fetch_climbs` of each, but those that would start from the zygote had it
    been up (`found_up` counts them so either way; among them an arrival at the very moment a climb begins); None
    where climbs take no time, or none is left."""
    if start_s is None:
        return None
    idx = np.flatnonzero(cold & (plans.codes[segs, step] != COLD))
    if not len(idx):
        return None
    since, up = plans.fetch_climbs(segs[idx], step[idx], gaps[idx], start_s)
    warmer = up != ZYGOTE
    return (idx[warmer], since[warmer], up[warmer]) if warmer.any() else None


def holdings(batch: Sequence[AppItems], fetch: tuple[np.ndarray, ...], w: np.ndarray, app: np.ndarray,
              cold: np.ndarray, g: np.ndarray, climb: tuple[np.ndarray, ...] | None = None) -> list[Holding]:
    """Each application's hold on its runtime's zygote: its FETCH intervals, absolute, in the order
    `evaluate_held` lists them (step by step): item idx[i] (of application app[idx[i]]) spends [lo[i], hi[i]) of each
    of its idle periods on FETCH (an arrival ends it where `ends`); and its starts from FETCH, those of the items
    in `cold` (idle for `g`): each ends an interval (the same float), or is at the very step its plan drops to
    FETCH, or comes while the plan climbs back from FETCH. `climb` (items, the idle time their chain of climbs
    began at, the level they start from had the zygote been up then; `PlanTable.fetch_climbs`): those of `cold`
    that come during a climb (`Holding.climb_at`)."""
    idx, lo, hi, ends = fetch
    if not len(idx) and not cold.any():
        return [Holding(it.first_s, np.zeros(0), np.zeros(0)) for it in batch]
    order = np.argsort(app[idx], kind="stable")
    idx, lo, hi, ends = idx[order], lo[order], hi[order], ends[order]
    at: list[Any] = []
    every: list[Any] = []
    for it in batch:
        at += [it.at, [it.trailing_at]]
        every += [it.every, [0.0]]
    at_, every_ = np.concatenate(at), np.concatenate(every)
    start, end = fetch_intervals(at_, every_, w, idx, lo, hi)
    reps = w[idx].astype(np.int64)
    ended = end[np.repeat(ends, reps)]
    instant = np.flatnonzero(cold)
    instant = instant[~np.isin(instant, idx[ends])]                     # no interval: none was on FETCH
    _, z = fetch_intervals(at_, every_, w, instant, g[instant], g[instant])
    cut = _cuts(app[idx], reps, len(batch))
    cut_e = _cuts(app[idx][ends], reps[ends], len(batch))
    cut_z = _cuts(app[instant], w[instant].astype(np.int64), len(batch))
    climbs = _climbs(climb, at_, every_, w, app, g, len(batch))
    return [Holding(it.first_s, start[cut[i]:cut[i + 1]], end[cut[i]:cut[i + 1]],
                    np.sort(np.concatenate([ended[cut_e[i]:cut_e[i + 1]], z[cut_z[i]:cut_z[i + 1]]])), *climbs[i])
            for i, it in enumerate(batch)]


def _climbs(climb: tuple[np.ndarray, ...] | None, at: np.ndarray, every: np.ndarray, w: np.ndarray, app: np.ndarray,
            g: np.ndarray, apps: int) -> list[tuple[np.ndarray, ...]]:
    """Per application, `Holding`'s (climb_at, climb_since, climb_up) from `holdings`' `climb`: absolute, each
    repeat of an item in turn; climb_at the floats of the same start among `fetch_starts`."""
    if climb is None or not len(climb[0]):
        return [(np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64))] * apps
    c_idx, c_since, c_up = climb
    order = np.argsort(app[c_idx], kind="stable")
    c_idx, c_since, c_up = c_idx[order], c_since[order], c_up[order]
    began, _ = fetch_intervals(at, every, w, c_idx, c_since, c_since)
    _, came = fetch_intervals(at, every, w, c_idx, g[c_idx], g[c_idx])
    reps = w[c_idx].astype(np.int64)
    up = np.repeat(c_up, reps)
    cut = _cuts(app[c_idx], reps, apps)
    return [(came[cut[i]:cut[i + 1]], began[cut[i]:cut[i + 1]], up[cut[i]:cut[i + 1]]) for i in range(apps)]


def _cuts(app: np.ndarray, reps: np.ndarray, apps: int) -> np.ndarray:
    """Where each application's entries begin in an array of `reps` entries per element, grouped by app."""
    return np.concatenate([[0], np.cumsum(np.bincount(app, weights=reps, minlength=apps).astype(np.int64))])


__all__ = ["BATCH_APPS", "OTHERS_WINDOW_S", "Priors", "evaluate_many", "fetch_climbs", "holdings", "ladder_runs",
           "needs"]
