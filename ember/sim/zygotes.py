"""Exact zygote accounting: each runtime's zygote is charged for the union of the times any model holds it.

The rule is the live server's (`ember.core.lifecycle.KEEPS` on the node): a model holds its
runtime's zygote from its first start on, while it executes and while its idle capacity sits on
any rung at or above the zygote (hot, paused, template, zygote); only "nothing kept" (FETCH)
lets go of it, and the node releases a runtime's zygote once no model of it holds it. So a
model's holding set is [first arrival, end of trace) less its FETCH intervals, and a runtime's
zygote lives on the union of its models' holding sets.

A start from "nothing kept" finds the zygote up if the other models of the runtime kept it up: live the node
then forks the model from it (a zygote start, not a full one), so the engine counts it as one
(`found_up`). Likewise a plan's climb back from "nothing kept" that begins while the zygote is up forks the
model from it, in a zygote start's time: a request that comes during such a climb starts from what the climb
reached by then (`climbs_up`).

The per-minute view (`held_per_minute`, `others_share`) feeds the ladder's marginal zygote
price: the share of each minute in which some other model of the runtime held the zygote.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ember.keepalive.zygote_share import MINUTE_S  # the live server's minutes (`ember.keepalive.zygote_share`)

# The disjoint, sorted intervals [start, end) in which no model of a runtime holds its zygote (`unheld_runs`).
Unheld = tuple[np.ndarray, np.ndarray]


@dataclass
class Holding:
    """One model's hold on its runtime's zygote: from `first_s` to the end of the trace but the FETCH intervals."""

    first_s: float
    fetch_lo: np.ndarray      # FETCH intervals [lo, hi), absolute seconds, disjoint
    fetch_hi: np.ndarray
    # When the model started from FETCH (its first arrival left out): each ends a FETCH interval, or is at the
    # very step its plan drops to FETCH, or comes while its plan still climbs back from FETCH.
    fetch_starts: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # Those of them that came while the plan climbed back from FETCH and would start warmer than the zygote had it
    # been up when that climb began: when (absolute), when that chain of climbs began, and that level
    # (`PlanTable.fetch_climbs`; `ember.sim.batched.fetch_climbs`).
    climb_at: np.ndarray = field(default_factory=lambda: np.zeros(0))
    climb_since: np.ndarray = field(default_factory=lambda: np.zeros(0))
    climb_up: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # Beside the hold: the model's idle seconds per level in its trailing period (from its last execution's end to
    # the end of the trace), for the yardstick's end rule that leaves that period out (`ember.sim.envelopes`).
    tail_s: np.ndarray = field(default_factory=lambda: np.zeros(5))


def fetch_intervals(at: np.ndarray, every: np.ndarray, weights: np.ndarray, idx: np.ndarray, lo: np.ndarray,
                    hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Absolute FETCH intervals from per-item relative ones: item idx[i] (idle from at[idx], repeated weights[idx]
    times every every[idx] seconds) spends [lo[i], hi[i]) of each of its idle periods on FETCH."""
    if not len(idx):
        return np.zeros(0), np.zeros(0)
    reps = weights[idx].astype(np.int64)
    base = at[idx] + lo
    if (reps == 1).all():
        return base, base + (hi - lo)
    k = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)     # repeat number within each item
    a = np.repeat(base, reps) + k * np.repeat(every[idx], reps)
    return a, a + np.repeat(hi - lo, reps)


def union_s(holdings: list[Holding], horizon_s: float, since_s: float = 0.0) -> float:
    """Seconds in which at least one of `holdings` holds the zygote (the union of their holding sets), from
    `since_s` on (a live replay compares from the time every model has served)."""
    if since_s > 0:
        holdings = [since(h, since_s) for h in holdings]
    live = [h for h in holdings if h.first_s < horizon_s]
    if not live:
        return 0.0
    if len(live) == 1:
        h = live[0]
        return float(horizon_s - h.first_s - (h.fetch_hi - h.fetch_lo).sum())
    times, count = _sweep(live)
    span = np.diff(np.append(times, horizon_s))
    return float(span[count > 0.5].sum())


def found_up(holds: list[Holding], ready_s: float, unheld: Unheld | None = None) -> np.ndarray:
    """Per model of one runtime: how many of its `fetch_starts` found the zygote up and ready: some model held it
    throughout the `ready_s` before (the node keeps it while any does). The model itself held it until its plan
    dropped to FETCH, so from then on the others must have; a zygote that another model's start, or the model's
    own climb back, made a moment before is not ready yet, and the start is a full one too. `unheld`: the holds'
    `unheld_runs` where the caller has them."""
    out = np.zeros(len(holds), dtype=np.int64)
    if len(holds) < 2 or not any(len(h.fetch_starts) for h in holds):
        return out
    starts, ends = unheld_runs(holds) if unheld is None else unheld
    r = max(ready_s, 1e-6)
    for m, h in enumerate(holds):
        t = h.fetch_starts
        if len(t):
            out[m] = int((~_hits(starts, ends, t - r, t)).sum())
    return out


def climbs_up(holds: list[Holding], ready_s: float, levels: int, unheld: Unheld | None = None) -> np.ndarray:
    """(models, levels): per model of one runtime, how many of its starts that came while its plan climbed back from
    FETCH found the zygote up and ready when that climb began (held throughout the `ready_s` before it, and
    throughout the `ready_s` before the start: `found_up` counts each such start a zygote start), by the level they
    start from then (`Holding.climb_up`): the climb forked the model from the zygote. `unheld` as in `found_up`."""
    out = np.zeros((len(holds), levels), dtype=np.int64)
    if len(holds) < 2 or not any(len(h.climb_at) for h in holds):
        return out
    starts, ends = unheld_runs(holds) if unheld is None else unheld
    r = max(ready_s, 1e-6)
    for m, h in enumerate(holds):
        if len(h.climb_at):
            up = ~_hits(starts, ends, h.climb_since - r, h.climb_since) & ~_hits(starts, ends, h.climb_at - r,
                                                                                   h.climb_at)
            out[m] = np.bincount(h.climb_up[up], minlength=levels)
    return out


def starts_up(holds: list[Holding], ready_s: float, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """`found_up` and `climbs_up` of the same holds, from one sweep of them (where either needs it)."""
    need = len(holds) > 1 and any(len(h.fetch_starts) or len(h.climb_at) for h in holds)
    unheld = unheld_runs(holds) if need else None
    return found_up(holds, ready_s, unheld), climbs_up(holds, ready_s, levels, unheld)


def unheld_runs(holds: list[Holding]) -> Unheld:
    """The disjoint, sorted intervals [start, end) in which no model holds the zygote."""
    times, count = _sweep(holds)
    last = np.append(times[1:] != times[:-1], True)            # the count once every event at a time is in
    times, count = times[last], count[last]
    unheld = np.concatenate([[True], count < 0.5])
    return np.concatenate([[-np.inf], times])[unheld], np.append(times, np.inf)[unheld]


def _sweep(holds: list[Holding]) -> tuple[np.ndarray, np.ndarray]:
    """The count of holders after each event, in time order: +1 at each first start and each FETCH interval's end,
    -1 at its start (each model's intervals merged first)."""
    holds = [_merged(h) for h in holds]
    times = np.concatenate([[h.first_s for h in holds], *[h.fetch_lo for h in holds], *[h.fetch_hi for h in holds]])
    n_lo = sum(len(h.fetch_lo) for h in holds)
    delta = np.concatenate([np.ones(len(holds)), -np.ones(n_lo), np.ones(n_lo)])
    order = np.argsort(times, kind="stable")
    return times[order], np.cumsum(delta[order])


def _merged(h: Holding) -> Holding:
    """`h` with its FETCH intervals sorted and those that meet merged: a sweep counts each model once. (Two of a
    model's periods can overlap by a rounding: with executions of no length, one period's FETCH interval may begin
    a float step before the previous one ends, and the model's count would go below 0 there.)"""
    lo, hi = h.fetch_lo, h.fetch_hi
    if len(lo) < 2 or (lo[1:] >= hi[:-1]).all():       # (most are: in time order and apart)
        return h
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    reach = np.maximum.accumulate(hi)
    if (lo[1:] >= reach[:-1]).all():
        return Holding(h.first_s, lo, hi)
    new = np.concatenate([[True], lo[1:] > reach[:-1]])
    ends = np.append(np.flatnonzero(new)[1:] - 1, len(lo) - 1)
    return Holding(h.first_s, lo[new], reach[ends])


def _hits(starts: np.ndarray, ends: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Whether [a, b) meets one of the disjoint, sorted intervals [starts, ends) (an empty [a, b) meets none)."""
    j = np.searchsorted(starts, b, side="left") - 1
    return (b > a) & (j >= 0) & (ends[np.maximum(j, 0)] > a)


def since(h: Holding, at_s: float) -> Holding:
    """`h` from `at_s` on: held from max(first, at_s), its FETCH intervals cut at `at_s` (those before it empty); its
    starts as they were."""
    return Holding(max(h.first_s, at_s), np.maximum(h.fetch_lo, at_s), np.maximum(h.fetch_hi, at_s), h.fetch_starts,
                   h.climb_at, h.climb_since, h.climb_up)


def until(h: Holding, at_s: float, horizon_s: float) -> Holding:
    """`h` up to `at_s` only: a FETCH interval from `at_s` to the horizon added, those after it dropped (the end
    rule that charges nothing after a model's last execution)."""
    if at_s >= horizon_s:
        return h
    keep = h.fetch_lo < at_s
    lo = np.append(h.fetch_lo[keep], max(at_s, h.first_s))
    hi = np.append(np.minimum(h.fetch_hi[keep], at_s), horizon_s)
    return Holding(h.first_s, lo, hi)


def held_s(h: Holding, horizon_s: float) -> float:
    """Seconds the model holds the zygote up to the horizon (from its first start, less its FETCH intervals)."""
    if h.first_s >= horizon_s:
        return 0.0
    m = _merged(h)
    return float(horizon_s - h.first_s - (np.minimum(m.fetch_hi, horizon_s) - np.minimum(m.fetch_lo, horizon_s)).sum())


def holds_at(h: Holding, at_s: np.ndarray) -> np.ndarray:
    """Whether the model holds the zygote at each time of `at_s`: from its first start on, but in a FETCH interval
    [lo, hi) (at hi, the arrival that ends one, it holds it again: it is starting)."""
    at_s = np.asarray(at_s, dtype=np.float64)
    inside = np.zeros(at_s.shape, dtype=bool)
    if len(h.fetch_lo):
        order = np.argsort(h.fetch_lo, kind="stable")
        lo, hi = h.fetch_lo[order], h.fetch_hi[order]
        k = np.searchsorted(lo, at_s, side="right") - 1
        inside = (k >= 0) & (at_s < hi[np.maximum(k, 0)])
    return (at_s >= h.first_s) & ~inside


def _ramp_sum(points: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """sum_i max(edge - points[i], 0) at each edge."""
    p = np.sort(points)
    c = np.searchsorted(p, edges, side="right")
    cs = np.concatenate([[0.0], np.cumsum(p)])
    return edges * c - cs[c]


def held_per_minute(h: Holding, horizon_s: float) -> np.ndarray:
    """(minutes,) share of each minute of the trace in which the model holds the zygote."""
    n = max(1, int(np.ceil(horizon_s / MINUTE_S)))
    edges = np.minimum(np.arange(n + 1) * MINUTE_S, horizon_s)
    held = np.maximum(edges - h.first_s, 0.0)
    if len(h.fetch_lo):
        held -= _ramp_sum(h.fetch_lo, edges) - _ramp_sum(h.fetch_hi, edges)
    width = np.maximum(np.diff(edges), 1e-9)
    return np.clip(np.diff(held) / width, 0.0, 1.0)


def held_per_minute_many(holds: list[Holding], horizon_s: float) -> np.ndarray:
    """(models, minutes): `held_per_minute` of each of `holds`, the same floats (one pass for those without FETCH)."""
    n = max(1, int(np.ceil(horizon_s / MINUTE_S)))
    edges = np.minimum(np.arange(n + 1) * MINUTE_S, horizon_s)
    held = np.maximum(edges - np.array([h.first_s for h in holds])[:, None], 0.0)
    for i, h in enumerate(holds):
        if len(h.fetch_lo):
            held[i] -= _ramp_sum(h.fetch_lo, edges) - _ramp_sum(h.fetch_hi, edges)
    width = np.maximum(np.diff(edges), 1e-9)
    return np.clip(np.diff(held, axis=1) / width, 0.0, 1.0)


def others_share(held: np.ndarray) -> np.ndarray:
    """(models, minutes) share of each minute in which some other model holds the zygote, from (models, minutes)
    per-model shares, taking the models' holding within a minute as independent."""
    logs = np.log(np.maximum(1.0 - held, 1e-12))
    return np.clip(1.0 - np.exp(logs.sum(axis=0, keepdims=True) - logs), 0.0, 1.0)


def trailing_mean(per_minute: np.ndarray, at_s: np.ndarray, window_s: float, prior: float) -> np.ndarray:
    """The mean of `per_minute` over the whole minutes of [at - window, at) for each time in `at_s` (`prior` where
    no whole minute precedes it): what a driver at time `at` has observed."""
    cum = np.concatenate([[0.0], np.cumsum(per_minute)])
    k = np.clip(np.floor(at_s / MINUTE_S).astype(np.int64), 0, len(per_minute))
    lo = np.maximum(k - round(window_s / MINUTE_S), 0)
    n = k - lo
    return np.where(n > 0, (cum[k] - cum[lo]) / np.maximum(n, 1), prior)


def trailing_means(per_minute: np.ndarray, row: np.ndarray, at_s: np.ndarray, window_s: float,
                   prior: float) -> np.ndarray:
    """`trailing_mean(per_minute[row[i]], at_s[i:i + 1], window_s, prior)` for each i (the same floats)."""
    cum = np.zeros((len(per_minute), per_minute.shape[1] + 1))
    np.cumsum(per_minute, axis=1, out=cum[:, 1:])
    k = np.clip(np.floor(at_s / MINUTE_S).astype(np.int64), 0, per_minute.shape[1])
    lo = np.maximum(k - round(window_s / MINUTE_S), 0)
    n = k - lo
    return np.where(n > 0, (cum[row, k] - cum[row, lo]) / np.maximum(n, 1), prior)


__all__ = ["Holding", "climbs_up", "fetch_intervals", "found_up", "held_per_minute", "held_per_minute_many", "holds_at",
           "others_share", "since", "starts_up", "trailing_mean", "trailing_means", "unheld_runs", "union_s"]
