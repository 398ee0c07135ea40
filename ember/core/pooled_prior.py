"""A pooled prior for the ladder: what a typical application's idle times look like, learnt from all of them.

The ladder smooths each application's idle-time histogram with `prior_weight` pseudo-observations of a prior.
An application with little history (most of a day's applications are rare) is then planned mostly from that
prior; the log-uniform one knows nothing about the workload. An empirical-Bayes prior learns it from the
other applications: the mean over applications of each one's empirical distribution of idle times over the
ladder's cells (each application counts once, however busy: the prior is over applications, and a busy one's
thousands of sub-second periods would otherwise decide every rare one's plan).

A `PooledPrior` holds P such priors (one per epoch of a trace in the simulator, built from the idle periods
that had ended by then: the past only; one for the node's models live) and which one each row of a
`HistoryTable` uses. The ladder mixes it with its log-uniform prior by `pooled_weight`
(`ember.core.keepalive.LadderPolicy`). The pooled histogram is right-censored: an idle period still running
(a long one, typically) is not in it yet, so alone it would favour short idle times; the mix keeps the
log-uniform prior's heavy tail.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ember.errors import InvalidInput


@dataclass(frozen=True)
class PooledPrior:
    """P priors over a ladder's cells, and the prior each table row uses."""

    mass: np.ndarray       # (P, c) share of an application's idle periods per cell (the last: beyond the range)
    head_sums: np.ndarray  # (P, h) E[idle; idle in head cell]: idle seconds per period ending in each head cell
    apps: np.ndarray       # (P,) applications pooled (0: none yet, the policy keeps its own prior)
    index: np.ndarray      # (m,) the prior of each table row

    def __post_init__(self) -> None:
        p = len(self.apps)
        if self.mass.shape[0] != p or self.head_sums.shape[0] != p:
            raise InvalidInput(f"pooled prior: {self.mass.shape[0]} masses, {self.head_sums.shape[0]} head sums "
                               f"and {p} counts of applications must agree")
        if len(self.index) and (self.index.min() < 0 or self.index.max() >= p):
            raise InvalidInput(f"pooled prior: row indices must lie in [0, {p}), got {self.index.min()} to "
                               f"{self.index.max()}")

    @property
    def cells(self) -> int:
        return int(self.mass.shape[1])

    def take(self, rows: np.ndarray) -> PooledPrior:
        return PooledPrior(self.mass, self.head_sums, self.apps, self.index[rows])

    def rows_for(self, index: np.ndarray) -> PooledPrior:
        """The same priors for other rows (e.g. one application's refresh points, or a batch of applications')."""
        return PooledPrior(self.mass, self.head_sums, self.apps, np.asarray(index, dtype=np.int64))


def pool(counts: np.ndarray, head_sums: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """From per-application idle periods per cell (A, c) and their idle seconds per head cell (A, h): the mean
    over the applications that have any of their empirical distributions, (c,), its head sums, (h,), and how
    many applications that is."""
    total = counts.sum(axis=1)
    seen = total > 0
    n = int(seen.sum())
    if n == 0:
        return np.zeros(counts.shape[1]), np.zeros(head_sums.shape[1]), 0
    share = counts[seen] / total[seen, None]
    sums = head_sums[seen] / total[seen, None]
    return share.mean(axis=0), sums.mean(axis=0), n


def kaplan_meier(counts: np.ndarray, censored: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """Per application (rows), its idle-time distribution over the cells (A, c) from its completed periods per
    cell and the one still running (`censored`: the cell its elapsed time is in, -1 if none), by Kaplan-Meier
    (a running period is at risk up to its cell, and ends in none). The mass the data leave beyond the last cell
    they reach is spread over the later cells as `tail` (c,) is (the log-uniform prior's masses), or left in the
    last cell if there is none."""
    pmf = _km_mass(counts, censored)
    rest = np.clip(1.0 - pmf.sum(axis=1), 0.0, 1.0)
    last_event = np.where(counts > 0, np.arange(counts.shape[1])[None, :], -1).max(axis=1)
    return pmf + rest[:, None] * _spread(np.maximum(censored, last_event), tail)


def _km_mass(counts: np.ndarray, censored: np.ndarray) -> np.ndarray:
    """(A, c) the Kaplan-Meier mass the data put in each cell (0 beyond the last cell an application's data
    reach: the first k cells' masses are those of its first k cells' counts alone)."""
    n_apps, n_cells = counts.shape
    cells = np.arange(n_cells)
    at_risk = np.cumsum(counts[:, ::-1], axis=1)[:, ::-1] + (cells[None, :] <= censored[:, None])
    with np.errstate(divide="ignore", invalid="ignore"):
        hazard = np.where(at_risk > 0, counts / at_risk, 0.0)
    alive = np.hstack([np.ones((n_apps, 1)), np.cumprod(1.0 - hazard, axis=1)[:, :-1]])
    return alive * hazard


def _spread(limit: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """(A, c) how the mass left beyond each application's last cell reached (`limit`) is spread over the cells."""
    n_cells = len(tail)
    cells = np.arange(n_cells)
    spread = np.where(cells[None, :] > limit[:, None], tail[None, :], 0.0)
    norm = spread.sum(axis=1, keepdims=True)
    return np.where(norm > 0, spread / np.where(norm > 0, norm, 1.0), (cells == n_cells - 1)[None, :])


def pool_censored(counts: np.ndarray, head_sums: np.ndarray, censored: np.ndarray,
                  tail: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """`pool`, each application's distribution by `kaplan_meier` (an application whose only period is still
    running counts too: it says its idle time is at least that long)."""
    seen = (counts.sum(axis=1) > 0) | (censored >= 0)
    n = int(seen.sum())
    if n == 0:
        return np.zeros(counts.shape[1]), np.zeros(head_sums.shape[1]), 0
    pmf = kaplan_meier(counts[seen], censored[seen], tail)
    heads = head_sums.shape[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        mean_in_cell = np.where(counts[seen, :heads] > 0, head_sums[seen] / counts[seen, :heads], 0.0)
    return pmf.mean(axis=0), (mean_in_cell * pmf[:, :heads]).mean(axis=0), n


def from_counts(counts: np.ndarray, head_sums: np.ndarray) -> PooledPrior:
    """One prior pooled from these applications' counts (the live node: its models' histories), for one row."""
    mass, sums, n = pool(counts, head_sums)
    return PooledPrior(mass[None, :], sums[None, :], np.array([n]), np.zeros(1, dtype=np.int64))


def epochs(ends: np.ndarray, apps: np.ndarray, cells: np.ndarray, gaps: np.ndarray, weights: np.ndarray,
           shape: tuple[int, int, int], epoch_s: float, n_epochs: int,
           censored: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Priors per epoch from idle periods with end times: prior e pools the periods that ended before e * epoch_s
    (the first, at time 0, pools none). `apps`, `cells`, `gaps` and `weights` give each item's application, cell
    of the ladder's grid, idle seconds and how many identical periods it stands for (a whole number, >= 0);
    `shape` is (applications, cells, head cells). With `censored` = (cells (E, A): the cell of each application's
    idle period running at each epoch, -1 if none; tail (c,)), each application's distribution is its
    Kaplan-Meier estimate (`pool_censored`). Returns (mass (E, c), head sums (E, h), applications pooled (E,)),
    each epoch's the same floats as `pool` or `pool_censored` give from its counts and head sums."""
    _, n_cells, n_heads = shape
    mass = np.zeros((n_epochs, n_cells))
    head = np.zeros((n_epochs, n_heads))
    pooled = np.zeros(n_epochs, dtype=np.int64)
    km = None if censored is None else _KaplanMeierPool(*censored)
    for e, (counts, sums, last) in enumerate(_so_far(ends, apps, cells, gaps, weights, shape, epoch_s, n_epochs)):
        mass[e], head[e], pooled[e] = pool(counts, sums) if km is None else km.pool(e, counts, sums, last)
    return mass, head, pooled


def _so_far(ends: np.ndarray, apps: np.ndarray, cells: np.ndarray, gaps: np.ndarray, weights: np.ndarray,
            shape: tuple[int, int, int], epoch_s: float, n_epochs: int
            ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per epoch, from the periods that ended before it: per application its counts per cell (A, c), idle seconds
    per head cell (A, h) and last cell with a count (A,; -1: none). The same arrays each time, updated in place."""
    n_apps, n_cells, n_heads = shape
    order, cuts = _by_end(ends, apps, np.arange(n_epochs) * epoch_s)
    apps, cells, gaps, weights = apps[order], cells[order], gaps[order], weights[order]
    counts = np.zeros((n_apps, n_cells))
    sums = np.zeros((n_apps, n_heads))
    last = np.full(n_apps, -1, dtype=np.int64)
    done = 0
    for cut in cuts:
        if cut > done:
            a, c, g, w = apps[done:cut], cells[done:cut], gaps[done:cut], weights[done:cut]
            # Whole numbers: the same counts in any order of additions (and only the items' cells, not all).
            np.add.at(counts.reshape(-1), a * n_cells + c, w)
            np.maximum.at(last, a[w > 0], c[w > 0])
            # Seconds are not: each cell's summed in the order of their ends, each epoch's added at once.
            h = c < n_heads
            sums += np.bincount(a[h] * n_heads + c[h], weights=g[h] * w[h],
                                minlength=n_apps * n_heads).reshape(n_apps, n_heads)
            done = cut
        yield counts, sums, last


def _by_end(ends: np.ndarray, apps: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The items in order of their ends (stable), and how many ended before each bound. Items sorted by
    application, then end, need only be ordered by the epoch they end in (a radix sort of small whole numbers):
    that keeps each application's in order of their ends, so each cell's sum of seconds adds them in that order."""
    da, de = np.diff(apps), np.diff(ends)
    if len(bounds) < 2**15 and np.all((da > 0) | ((da == 0) & (de >= 0))):
        epoch = np.searchsorted(bounds, ends, side="right").astype(np.int16)   # the first bound above its end
        order = np.argsort(epoch, kind="stable")
        return order, np.searchsorted(epoch[order], np.arange(len(bounds)), side="right")
    order = np.argsort(ends, kind="stable")
    return order, np.searchsorted(ends[order], bounds, side="left")


class _KaplanMeierPool:
    """`pool_censored` epoch after epoch, with the same floats, faster: the Kaplan-Meier estimate is worked out
    over the cells that some application's data reach (a few seconds' worth, for busy ones), the tail's spread
    for each last cell is computed once, and the (A, c) buffers are reused. `censored` (E, A) and `tail` (c,): as
    `epochs` takes them."""

    def __init__(self, censored: np.ndarray, tail: np.ndarray) -> None:
        n_apps, n_cells = censored.shape[1], len(tail)
        self.censored = censored
        self.spreads = _spread(np.arange(-1, n_cells), tail)   # row k + 1: the spread beyond cell k
        self.mass = np.zeros((n_apps, n_cells))                 # zero beyond the first `self.dirty` cells
        self.out = np.empty((n_apps, n_cells))
        self.dirty = 0

    def pool(self, epoch: int, counts: np.ndarray, head_sums: np.ndarray,
             last: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        censored = self.censored[epoch]
        rows = np.flatnonzero((last >= 0) | (censored >= 0))   # (whole counts >= 0: last >= 0 iff any)
        n = len(rows)
        if n == 0:
            return np.zeros(counts.shape[1]), np.zeros(head_sums.shape[1]), 0
        limit = np.maximum(censored[rows], last[rows])
        reach = int(limit.max()) + 1
        mass = self.mass[:n]
        mass[:, :reach] = _km_mass(counts[rows, :reach], censored[rows])
        mass[:, reach:self.dirty] = 0.0
        self.dirty = max(self.dirty, reach)
        # As `kaplan_meier`: the row sums over all the cells (zeros included: numpy sums a row pairwise).
        rest = np.clip(1.0 - mass.sum(axis=1), 0.0, 1.0)
        pmf = np.take(self.spreads, limit + 1, axis=0, out=self.out[:n])
        pmf *= rest[:, None]
        pmf[:, :reach] += mass[:, :reach]                       # beyond, the mass is 0: x + 0 is x
        heads = head_sums.shape[1]
        n_head = counts[rows, :heads]
        with np.errstate(divide="ignore", invalid="ignore"):
            mean_in_cell = np.where(n_head > 0, head_sums[rows] / n_head, 0.0)
        return pmf.mean(axis=0), (mean_in_cell * pmf[:, :heads]).mean(axis=0), n
