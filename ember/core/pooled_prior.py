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
    n_apps, n_cells = counts.shape
    cells = np.arange(n_cells)
    at_risk = np.cumsum(counts[:, ::-1], axis=1)[:, ::-1] + (cells[None, :] <= censored[:, None])
    with np.errstate(divide="ignore", invalid="ignore"):
        hazard = np.where(at_risk > 0, counts / at_risk, 0.0)
    alive = np.hstack([np.ones((n_apps, 1)), np.cumprod(1.0 - hazard, axis=1)[:, :-1]])
    pmf = alive * hazard
    rest = np.clip(1.0 - pmf.sum(axis=1), 0.0, 1.0)
    last_event = np.where(counts > 0, cells[None, :], -1).max(axis=1)
    later = cells[None, :] > np.maximum(censored, last_event)[:, None]
    spread = np.where(later, tail[None, :], 0.0)
    norm = spread.sum(axis=1, keepdims=True)
    spread = np.where(norm > 0, spread / np.where(norm > 0, norm, 1.0), (cells == n_cells - 1)[None, :])
    return pmf + rest[:, None] * spread


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
    of the ladder's grid, idle seconds and how many identical periods it stands for; `shape` is (applications,
    cells, head cells). With `censored` = (cells (E, A): the cell of each application's idle period running at
    each epoch, -1 if none; tail (c,)), each application's distribution is its Kaplan-Meier estimate
    (`pool_censored`). Returns (mass (E, c), head sums (E, h), applications pooled (E,))."""
    n_apps, n_cells, n_heads = shape
    order = np.argsort(ends, kind="stable")
    ends, apps, cells, gaps, weights = ends[order], apps[order], cells[order], gaps[order], weights[order]
    cuts = np.searchsorted(ends, np.arange(n_epochs) * epoch_s, side="left")
    counts = np.zeros((n_apps, n_cells))
    sums = np.zeros((n_apps, n_heads))
    mass = np.zeros((n_epochs, n_cells))
    head = np.zeros((n_epochs, n_heads))
    pooled = np.zeros(n_epochs, dtype=np.int64)
    done = 0
    for e, cut in enumerate(cuts):
        if cut > done:
            a, c, g, w = apps[done:cut], cells[done:cut], gaps[done:cut], weights[done:cut]
            counts += np.bincount(a * n_cells + c, weights=w, minlength=n_apps * n_cells).reshape(n_apps, n_cells)
            h = c < n_heads
            sums += np.bincount(a[h] * n_heads + c[h], weights=g[h] * w[h],
                                minlength=n_apps * n_heads).reshape(n_apps, n_heads)
            done = cut
        if censored is None:
            mass[e], head[e], pooled[e] = pool(counts, sums)
        else:
            mass[e], head[e], pooled[e] = pool_censored(counts, sums, censored[0][e], censored[1])
    return mass, head, pooled
