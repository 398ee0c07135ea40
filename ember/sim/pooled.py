"""The ladder's pooled prior in the simulator: per epoch, from the idle periods of every application that had
ended by then (the past only, as a live node would have seen them).

Every application's refresh points use the prior of the epoch they fall in, pooled from the periods that ended
before the epoch began (`ember.keepalive.pooled_prior.epochs_of`, fed a few hundred applications at a time). A repeated
item (a 2019 minute's evenly spaced arrivals) counts once its last period has ended. The priors depend on the trace
and on the ladder's grid alone (not on its knob), so they are computed once per trace and grid and reused across a
sweep.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from ember.keepalive.policies import LadderPolicy
from ember.keepalive.pooled_prior import POOL_EPOCH_S, Part, PooledPrior, SortedGrid, epochs_of

if TYPE_CHECKING:
    from ember.sim.engine import AppItems

# Items per part of the build (`_parts`): each of its arrays stays within the processor's cache (~0.5 MB).
PART_ITEMS = 1 << 16
_CACHE: dict[tuple[object, ...], tuple[list[AppItems], PooledPrior, list[np.ndarray]]] = {}
_CACHE_SIZE = 4


def trace_priors(policy: LadderPolicy, all_items: list[AppItems], active: list[int],
                 horizon_s: float) -> tuple[PooledPrior, dict[int, np.ndarray]]:
    """The epochs' priors (with no rows) and, per active application, the prior index of each refresh point."""
    starts = policy.cell_starts()
    key = (id(all_items), len(all_items), tuple(active), horizon_s, tuple(starts))
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not all_items:
        base, index = _build(starts, policy.spec.head_splits + 1, all_items, active, horizon_s,
                             policy.prior_masses())
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        hit = _CACHE[key] = (all_items, base, index)
    return hit[1], dict(zip(active, hit[2], strict=True))


def _build(starts: np.ndarray, heads: int, all_items: list[AppItems], active: list[int], horizon_s: float,
           tail: np.ndarray, part_items: int = PART_ITEMS) -> tuple[PooledPrior, list[np.ndarray]]:
    n_epochs = int(np.ceil(horizon_s / POOL_EPOCH_S)) + 1
    at = np.arange(n_epochs) * POOL_EPOCH_S
    its = [all_items[i] for i in active]
    running = _running(its, at, starts, part_items) if its else None
    mass, head, pooled = epochs_of(_parts(its, starts, part_items), (len(its), len(starts), heads), POOL_EPOCH_S,
                                   n_epochs, None if running is None else (running, tail))
    base = PooledPrior(mass, head, pooled, np.zeros(0, dtype=np.int64))
    return base, [np.minimum(np.floor(it.seg_t / POOL_EPOCH_S), n_epochs - 1).astype(np.int64) for it in its]


def _spans(its: list[AppItems], part_items: int) -> Iterator[tuple[int, int]]:
    """The applications a few at a time, [lo, hi): at least one, and about `part_items` items (one may hold more)."""
    ends = np.cumsum([len(it.gaps) for it in its])
    lo = 0
    while lo < len(its):
        begin = int(ends[lo - 1]) if lo else 0
        hi = max(lo + 1, int(np.searchsorted(ends, begin + part_items, side="right")))
        yield lo, hi
        lo = hi


def _cat(its: list[AppItems], *names: str) -> Iterator[np.ndarray]:
    """Fields of the applications' items, end to end."""
    return (np.concatenate([getattr(it, name) for it in its]) for name in names)


def _parts(its: list[AppItems], starts: np.ndarray, part_items: int) -> Iterator[Part]:
    """Every application's idle periods, with their ends and cells of the grid `starts`, a few applications at a
    time (`ember.keepalive.pooled_prior.epochs_of`), each application's in order."""
    grid = SortedGrid.of(starts)
    for lo, hi in _spans(its, part_items):
        gaps, weights, begins, every = _cat(its[lo:hi], "gaps", "weights", "at", "every")
        apps = np.repeat(np.arange(lo, hi), [len(it.gaps) for it in its[lo:hi]])
        idle = np.flatnonzero(gaps >= 0)          # a busy item (an arrival during an execution) is no idle period
        w, g = np.take(weights, idle), np.take(gaps, idle)
        ends = np.take(begins, idle) + g + np.maximum(w - 1, 0) * np.take(every, idle)
        yield ends, np.take(apps, idle), grid.right(g) - 1, g, w.astype(np.float64)


def _running(its: list[AppItems], at: np.ndarray, starts: np.ndarray, part_items: int) -> np.ndarray:
    """(E, A) the cell of each app's idle period still running at each epoch `at` (-1: none, or not started yet): a
    right-censored observation, "at least this long" (`ember.keepalive.pooled_prior.kaplan_meier`). A repeated item
    (periods under a minute) is taken as never running across an epoch."""
    out = np.full((len(at), len(its)), -1, dtype=np.int64)
    bounds, grid = SortedGrid.of(at), SortedGrid.of(starts)
    for lo, hi in _spans(its, part_items):
        begin, end, first = _singles(its[lo:hi])
        n = hi - lo
        # Per app and epoch, its periods begun before the epoch (those whose first bound above their beginning is at
        # or before it): the last of them is the one that may still run.
        app = np.repeat(np.arange(n), np.diff(np.append(first, len(begin))))
        begun = np.bincount(app * (len(at) + 1) + bounds.right(begin), minlength=n * (len(at) + 1))
        begun = np.cumsum(begun.reshape(n, len(at) + 1)[:, :-1], axis=1)
        last = np.where(begun > 0, first[:, None] + begun - 1, 0)
        on = (begun > 0) & (np.take(end, last) > at[None, :])
        cell = grid.right(at[None, :] - np.take(begin, last)) - 1
        out[:, lo:hi] = np.where(on, cell, -1).T
    return out


def _singles(its: list[AppItems]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The applications' single idle periods then their trailing one, each application's in order of beginning
    (ties: in the order given): their beginnings, ends (the trailing one's: +inf) and where each app's begin."""
    gaps, weights, begins = _cat(its, "gaps", "weights", "at")
    single = (gaps >= 0) & (weights == 1)
    apps = np.repeat(np.arange(len(its)), [len(it.gaps) for it in its])
    per_app = np.bincount(apps[single], minlength=len(its))
    trailing = np.cumsum(per_app + 1) - 1                        # each app's trailing period after its single ones
    kept = np.ones(len(trailing) + int(per_app.sum()), dtype=bool)   # where the single ones go
    kept[trailing] = False
    begin, end = np.empty(len(kept)), np.full(len(kept), np.inf)
    begin[kept], end[kept] = begins[single], begins[single] + gaps[single]
    begin[trailing] = [it.trailing_at for it in its]
    first = trailing - per_app
    app = np.repeat(np.arange(len(its)), per_app + 1)
    if not np.all((np.diff(begin) >= 0) | (np.diff(app) > 0)):
        order = np.lexsort((begin, app))                         # (stable)
        begin, end = begin[order], end[order]
    return begin, end, first
