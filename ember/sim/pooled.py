"""The ladder's pooled prior in the simulator: per epoch, from the idle periods of every application that had
ended by then (the past only, as a live node would have seen them).

Every application's refresh points use the prior of the epoch they fall in, pooled from the periods that ended
before the epoch began (`ember.core.pooled_prior.epochs`). A repeated item (a 2019 minute's evenly spaced
arrivals) counts once its last period has ended. The priors depend on the trace and on the ladder's grid
alone (not on its knob), so they are computed once per trace and grid and reused across a sweep.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ember.core.keepalive import LadderPolicy
from ember.core.pooled_prior import PooledPrior, epochs

if TYPE_CHECKING:
    from ember.sim.engine import AppItems

# How often the pooled prior is renewed: each refresh point uses the one of its epoch.
POOL_EPOCH_S = 600.0
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


def _build(starts: np.ndarray, heads: int, all_items: list[AppItems], active: list[int],
           horizon_s: float, tail: np.ndarray) -> tuple[PooledPrior, list[np.ndarray]]:
    n_epochs = int(np.ceil(horizon_s / POOL_EPOCH_S)) + 1
    at = np.arange(n_epochs) * POOL_EPOCH_S
    its = [all_items[i] for i in active]
    # Every application's items end to end, app after app, each app's in order (so, their periods ending in order,
    # `epochs` need only group them by epoch, not sort them all by end).
    gaps, weights, begins, every = (_cat(its, f) for f in ("gaps", "weights", "at", "every"))
    apps = np.repeat(np.arange(len(its)), [len(it.gaps) for it in its])
    idle = gaps >= 0                              # a busy item (an arrival during an execution) is no idle period
    w, g = weights[idle], gaps[idle]
    ends = begins[idle] + g + np.maximum(w - 1, 0) * every[idle]
    cells = np.searchsorted(starts, g, side="right") - 1
    running = np.stack([_running(it, at, starts) for it in its], axis=1) if its else None
    mass, head, pooled = epochs(ends, apps[idle], cells, g, w.astype(np.float64), (len(its), len(starts), heads),
                                POOL_EPOCH_S, n_epochs, None if running is None else (running, tail))
    base = PooledPrior(mass, head, pooled, np.zeros(0, dtype=np.int64))
    seg_t = _cat(its, "seg_t")
    index = np.minimum(np.floor(seg_t / POOL_EPOCH_S), n_epochs - 1).astype(np.int64)
    return base, np.split(index, np.cumsum([len(it.seg_t) for it in its])[:-1]) if its else []


def _cat(its: list[AppItems], name: str) -> np.ndarray:
    """One field of every application's items, end to end."""
    return np.concatenate([getattr(it, name) for it in its]) if its else np.zeros(0)


def _running(it: AppItems, at: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """(E,) the cell of the app's idle period still running at each epoch (-1: none, or not started yet): a
    right-censored observation, "at least this long" (`ember.core.pooled_prior.kaplan_meier`). A repeated item
    (periods under a minute) is taken as never running across an epoch."""
    single = (it.gaps >= 0) & (it.weights == 1)
    begin = np.append(it.at[single], it.trailing_at)
    end = np.append(it.at[single] + it.gaps[single], np.inf)     # the trailing period runs to the end
    order = np.argsort(begin, kind="stable")
    begin, end = begin[order], end[order]
    last = np.searchsorted(begin, at, side="left") - 1
    ok = last >= 0
    on = np.zeros(len(at), dtype=bool)
    on[ok] = end[last[ok]] > at[ok]
    out = np.full(len(at), -1, dtype=np.int64)
    out[on] = np.searchsorted(starts, at[on] - begin[last[on]], side="right") - 1
    return out
