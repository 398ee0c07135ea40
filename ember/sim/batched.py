"""Many applications' idle periods evaluated against their plans in one numpy pass.

The per-application engine (`ember.sim.engine.evaluate_held`) costs a few dozen numpy calls per
application whatever its size; a day of a thousand rare applications is then mostly call overhead. Here
a batch's items are laid end to end (each application's rows of the plan table follow the previous
one's) and every sum is kept per (application, level): each application's figures are the very floats
`evaluate_held` gives it, added up in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ember.core.keepalive import COLD, HOT, LEVELS, PlanTable
from ember.sim.zygotes import Holding, fetch_intervals

if TYPE_CHECKING:
    from ember.sim.engine import AppItems

_N = len(LEVELS)
Run = tuple[np.ndarray, np.ndarray, Holding]


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


def evaluate_many(plans: PlanTable, batch: Sequence[AppItems], rows: Sequence[int]) -> list[Run]:
    """`ember.sim.engine.evaluate_held` of each application of `batch`, whose plans are `rows` rows each of
    `plans`, end to end: per application, starts and idle seconds per level, and its hold on the zygote.

    Every step of every item's plan at once, as (steps, items) arrays."""
    gaps, w, segs, app, last = _items(batch, rows)
    a, n = len(batch), len(gaps)
    begin = np.take(plans.breaks.T, segs, axis=1)                      # (steps, items) each step's start
    code = np.take(plans.codes.T, segs, axis=1)
    end = np.empty_like(begin)
    end[:-1] = begin[1:]
    end[-1] = np.inf
    busy = gaps < 0
    g = np.maximum(gaps, 0.0)
    reached = g >= begin
    with np.errstate(invalid="ignore"):
        upto = np.minimum(g, end)
        held = np.where(reached, upto - begin, 0.0)
    idle_w = np.where(busy, 0.0, w)                                     # a busy instance is not idle
    steps = len(begin)
    # Per (step, application, level), the items' idle seconds in order; then the steps one after the other.
    at = (np.arange(steps)[:, None] * a + app) * _N + code
    per_step = np.bincount(at.ravel(), weights=(idle_w * held).ravel(), minlength=steps * a * _N)
    per_step = per_step.reshape(steps, a * _N)
    idle = np.zeros(a * _N)
    for j in range(steps):
        idle += per_step[j]
    level = code[steps - 1 - np.argmax(reached[::-1], axis=0), np.arange(n)]   # the last step begun (all begin at 0)
    level = np.where(busy, HOT, level)
    counted = np.ones(n, dtype=bool)
    counted[last] = False                                               # the trailing period: no arrival ends it
    starts = np.bincount(app[counted] * _N + level[counted], weights=w[counted], minlength=a * _N).reshape(a, _N)
    starts[:, COLD] += 1                                                # each first arrival: nothing existed
    on_fetch = (code == COLD) & (held > 0) & ~busy
    step, item = np.nonzero(on_fetch)                                   # step by step, as evaluate_held lists them
    holds = _holdings(batch, item, begin[step, item], upto[step, item], w, app)
    per_level = idle.reshape(a, _N)
    return [(starts[i], per_level[i], holds[i]) for i in range(a)]


def _holdings(batch: Sequence[AppItems], idx: np.ndarray, lo: np.ndarray, hi: np.ndarray, w: np.ndarray,
              app: np.ndarray) -> list[Holding]:
    """Each application's FETCH intervals, absolute, in the order `evaluate_held` lists them (step by step): item
    idx[i] spends [lo[i], hi[i]) of each of its idle periods on FETCH."""
    if not len(idx):
        return [Holding(it.first_s, np.zeros(0), np.zeros(0)) for it in batch]
    order = np.argsort(app[idx], kind="stable")
    idx, lo, hi = idx[order], lo[order], hi[order]
    at: list[Any] = []
    every: list[Any] = []
    for it in batch:
        at += [it.at, [it.trailing_at]]
        every += [it.every, [0.0]]
    start, end = fetch_intervals(np.concatenate(at), np.concatenate(every), w, idx, lo, hi)
    per_app = np.bincount(app[idx], weights=w[idx], minlength=len(batch)).astype(np.int64)
    cut = np.concatenate([[0], np.cumsum(per_app)])
    return [Holding(it.first_s, start[cut[i]:cut[i + 1]], end[cut[i]:cut[i + 1]]) if per_app[i]
            else Holding(it.first_s, np.zeros(0), np.zeros(0)) for i, it in enumerate(batch)]


__all__ = ["evaluate_many", "needs"]
