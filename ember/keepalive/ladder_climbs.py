"""The ladder's plans with their climbs' lead times: the cheapest sequence of levels when a climb is not instant.

`ember.keepalive.ladder_cells.decide` takes the cheapest level cell by cell, which is the cheapest plan when a climb
back to a warmer rung takes no time. It does take time (the simulator and the live node start the instance,
template or zygote when the step begins, and a request that comes before it is up starts from where the climb
began), so a plan that drops through a dip of the hazard between bursts and climbs back for the next one pays the
warmer rung's memory and still starts that burst's first requests from the colder one. Here the rows whose plan
climbs are planned again over the sequence of levels: each cell's expected cost weighted by the chance of still
being idle when it begins, plus, per climb from a to a warmer b at a cell's start, the extra charge of the starts
during its lead time (start_s[a] - start_s[b]):

    total = sum_c S_c x cost(l_c, c) + sum_{c: l_c warmer than l_(c-1)} (per_start[l_(c-1)] - per_start[l_c])
            x (S(t_c) - S(t_c + lead)),

S the chance of being idle at an idle time (the hazards' product; linear within a cell). A dynamic programme over
the cells finds the least total. Without climbs the sum splits cell by cell and its least is the greedy plan;
rows whose greedy plan never climbs keep it. The lead is charged as if the climb's rung were held through it,
which overstates a climb whose rung is left before it is up: such a climb is never worth its memory anyway. A
climb begun while another is still under way is charged on its own (from the rung it begins on, for its own
lead), where the simulator starts requests from the rung the chain began on until its last climb is done: chains
are undercharged (none arose among 5,365 random rows with the reference costs' candidates, hot, the zygote and
nothing; a measured template rung makes them possible). `ember.keepalive.ladder_cells` applies this to the head cells
only, the last free (a climb into the first later cell is planned as instant).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# The least weight of a cell: one nobody reaches any more still orders its levels by its own costs.
MIN_ALIVE = 1e-9


def plan_climbs(levels: np.ndarray, lead_s: np.ndarray, costs: np.ndarray, h: np.ndarray, starts: np.ndarray,
                ends: np.ndarray, per_start: Any) -> np.ndarray:
    """(n, r) level codes of the least total (module docstring) for r rows of n cells.

    `levels` the candidate level codes (warmest first), `lead_s` per level code the seconds a start from it takes,
    `costs` (L, n, r) each candidate's expected cost per cell given idle at its start, `h` (n, r) the hazards,
    `starts` and `ends` (n,) where each cell begins and ends, `per_start` (levels,) or (levels, r) the charge per
    start from each level code."""
    n, r = h.shape
    alive = np.ones((n + 1, r))
    np.cumprod(1.0 - h, axis=0, out=alive[1:])
    weighted = costs * np.maximum(alive[:n], MIN_ALIVE)
    pairs = [(i, j) for i in range(len(levels)) for j in range(i)]     # from i to a warmer j
    if not pairs:
        return np.broadcast_to(levels[:1, None], (n, r)).copy()
    a_idx, b_idx = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
    lead = lead_s[levels[a_idx]] - lead_s[levels[b_idx]]                 # (P,)
    ps = np.asarray(per_start, dtype=np.float64)
    dps = ps[levels[a_idx]] - ps[levels[b_idx]]                           # (P,) or (P, r)
    dps = dps[:, None] if dps.ndim == 1 else dps
    k, frac = _lead_cells(starts, ends, lead)                             # (P, n) each
    best = weighted[:, 0].copy()                                          # (L, r): at cell 0, from hot (a drop)
    back = np.zeros((n, len(levels), r), dtype=np.int8)
    extra = np.zeros((len(levels), len(levels), r))                       # (from, to, r): the climbs' charges
    cand = np.empty_like(extra)
    lower = np.empty((len(levels), r), dtype=bool)
    for c in range(1, n):
        kc = k[:, c]
        up_by = alive[kc]                                                 # (P, r): arrivals during the lead
        up_by *= h[kc] * frac[:, c, None] - 1.0
        up_by += alive[c]
        np.maximum(up_by, 0.0, out=up_by)
        up_by *= dps
        extra[a_idx, b_idx] = up_by
        np.add(best[:, None, :], extra, out=cand)
        _least(cand, back[c], best, lower)
        best += weighted[:, c]
    out = np.empty((n, r), dtype=np.int64)
    out[-1] = np.argmin(best, axis=0)
    for c in range(n - 1, 0, -1):
        out[c - 1] = np.take_along_axis(back[c], out[c][None], axis=0)[0]
    return levels[out]


def _least(cand: np.ndarray, arg: np.ndarray, out: np.ndarray, lower: np.ndarray) -> None:
    """np.argmin and np.min of `cand` over its first axis into `arg` and `out` (ties to the first), as contiguous
    row comparisons: a reduction over a short leading axis runs strided, several times slower."""
    arg[:] = 0
    out[:] = cand[0]
    for a in range(1, len(cand)):
        np.less(cand[a], out, out=lower)
        np.copyto(arg, a, where=lower)
        np.copyto(out, cand[a], where=lower)


def _lead_cells(starts: np.ndarray, ends: np.ndarray, lead: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each lead (P,) and cell (n,): the cell its climb is done in (the last, if beyond) and how far into it
    (a share of its width, at most 1)."""
    done = starts[None, :] + lead[:, None]
    k = np.clip(np.searchsorted(starts, done, side="right") - 1, 0, len(starts) - 1)
    width = np.maximum(ends[k] - starts[k], 1e-12)
    return k, np.clip((done - starts[k]) / width, 0.0, 1.0)


__all__ = ["MIN_ALIVE", "plan_climbs"]
