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
(`ember.keepalive.policies.LadderPolicy`). The pooled histogram is right-censored: an idle period still running
(a long one, typically) is not in it yet, so alone it would favour short idle times; the mix keeps the
log-uniform prior's heavy tail.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from ember.errors import InvalidInput

# How often the pooled prior is renewed, in the simulator (`ember.sim.pooled`: each refresh point uses its epoch's)
# and live (`ember.serving.actuator`): from the periods that ended before the epoch began; the first pools none.
POOL_EPOCH_S = 600.0


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
    reach: the first k cells' masses are those of its first k cells' counts alone). Row-major (a row's sum, pairwise
    along a contiguous row, depends on it). `counts` is left as it was (the cell-major copy is consumed)."""
    return np.ascontiguousarray(_km_mass_by_cell(np.array(counts.T, dtype=np.float64, order="C"), censored).T)


def _km_mass_by_cell(counts: np.ndarray, censored: np.ndarray) -> np.ndarray:
    """`_km_mass` cell-major: (c, A) from counts (c, A), consumed. A cell's row at a time (numpy runs faster along
    the long axis): the periods at risk summed from the last cell down (whole numbers: exact in any order), the
    survival multiplied up from the first, factor after factor as a cumulative product does."""
    n_cells = len(counts)
    at_risk = counts.copy()
    for j in range(n_cells - 2, -1, -1):
        at_risk[j] += at_risk[j + 1]
    at_risk += np.arange(n_cells)[:, None] <= censored[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        hazard = np.divide(counts, at_risk, out=counts)
    np.copyto(hazard, 0.0, where=at_risk <= 0)                  # (no NaN: 0 / 0 only where at_risk is 0)
    np.subtract(1.0, hazard, out=at_risk)                       # 1 - hazard per cell
    alive = np.empty_like(hazard)                               # the survival to each cell's start
    alive[:1] = 1.0
    alive[1:2] = at_risk[:1]
    for j in range(2, n_cells):                                 # factor after factor, as np.cumprod multiplies
        np.multiply(alive[j - 1], at_risk[j - 1], out=alive[j])
    alive *= hazard
    return alive


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


# Items given in parts (`epochs_of`): (ends, apps, cells, gaps, weights), each as `epochs` takes them.
Part = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


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
    return epochs_of([(ends, apps, cells, gaps, weights)], shape, epoch_s, n_epochs, censored)


def epochs_of(parts: Iterable[Part], shape: tuple[int, int, int], epoch_s: float, n_epochs: int,
              censored: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`epochs` of the items of `parts`, each part holding every item of its applications (no application in two):
    the same floats however the applications are split. Parts of a few hundred applications keep every temporary
    small (a simulated day's items end to end take ~14 MB an array: each new one is memory the system must hand
    over and fill, slower than the arithmetic on it)."""
    _, n_cells, n_heads = shape
    mass = np.zeros((n_epochs, n_cells))
    head = np.zeros((n_epochs, n_heads))
    pooled = np.zeros(n_epochs, dtype=np.int64)
    km = None if censored is None else _KaplanMeierPool(*censored)
    ended = _Ended.of(parts, shape, epoch_s, n_epochs)
    for e, (counts, sums, last) in enumerate(ended.so_far()):
        mass[e], head[e], pooled[e] = pool(counts, sums) if km is None else km.pool(e, counts, sums, last)
    return mass, head, pooled


@dataclass(frozen=True)
class SortedGrid:
    """np.searchsorted(edges, x, side="right") for many x, the same integers, faster: a table over a regular grid
    as fine as the edges' closest pair guesses each item's index, and the guess is checked; the search is made only
    where it is wrong. (A binary search costs ~15 ns an item, one mispredicted branch a level; the guess and its
    check, a few. On a grid whose edges are multiples of its step, only rounding makes a guess wrong.)"""

    edges: np.ndarray
    table: np.ndarray | None   # per step of the grid from edges[0], the index of its start (None: no grid)
    step: float

    @staticmethod
    def of(edges: np.ndarray, most: int = 1 << 20) -> SortedGrid:
        """The grid of `edges` (ascending), with a table of at most `most` entries (else a plain search)."""
        if not len(edges):
            return SortedGrid(edges, None, 1.0)
        gaps = np.diff(edges)
        step = float(gaps.min()) if len(gaps) else 1.0
        span = float(edges[-1] - edges[0])
        if not (step > 0 and np.isfinite(span) and span / step < most):
            return SortedGrid(edges, None, 1.0)
        at = edges[0] + np.arange(int(span / step) + 2) * step
        return SortedGrid(edges, np.searchsorted(edges, at, side="right"), step)

    def right(self, x: np.ndarray) -> np.ndarray:
        """np.searchsorted(self.edges, x, side="right")."""
        edges = self.edges
        if self.table is None:
            return np.searchsorted(edges, x, side="right")
        shape, x = np.shape(x), np.ravel(x)
        u = np.subtract(x, edges[0])                             # the step of the grid, in place
        u /= self.step
        np.floor(u, out=u)
        np.fmin(u, len(self.table) - 1, out=u)                   # (fmin, fmax: a NaN becomes a number)
        np.fmax(u, 0, out=u)
        at = np.take(self.table, u.astype(np.int64))
        ext = np.concatenate([[-np.inf], edges, [np.inf]])       # index i lies in [ext[i], ext[i + 1])
        ok = np.take(ext[:-1], at) <= x
        ok &= x < np.take(ext[1:], at)
        bad = np.flatnonzero(~ok)
        if len(bad):
            at[bad] = np.searchsorted(edges, x[bad], side="right")
        return at.reshape(shape)


@dataclass(frozen=True)
class _Piece:
    """One part's items in order of the epoch they end in (each application's in order of their ends): per item its
    application's row and cell (app * cells + cell) and weight (None: all 1); per item in a head cell, its (app *
    heads + cell) and idle seconds times weight; where each epoch's items begin in each ((E + 1,): those ending at
    or after the last epoch's start are left out)."""

    keys: np.ndarray
    weights: np.ndarray | None
    begin: np.ndarray
    head_keys: np.ndarray
    head_s: np.ndarray
    head_begin: np.ndarray

    @staticmethod
    def of(part: Part, shape: tuple[int, int, int], bounds: SortedGrid, last: np.ndarray) -> _Piece:
        """The piece of `part`; each of its applications' last cell with a count by each epoch set in `last` (E,
        A)."""
        ends, apps, cells, gaps, weights = part
        _, n_cells, n_heads = shape
        n_epochs = len(last)
        da = np.diff(apps)
        if not np.all((da > 0) | ((da == 0) & (np.diff(ends) >= 0))):
            order = np.lexsort((ends, apps))                    # (stable: ties in the order given)
            ends, apps, cells, gaps, weights = (np.take(x, order) for x in (ends, apps, cells, gaps, weights))
        # The first bound above its end: an application's items in order of their ends are in order of their
        # epochs, and a stable sort by epoch keeps them so (by application, then end, within an epoch).
        epoch = bounds.right(ends)
        order = np.argsort(epoch.astype(np.int16) if n_epochs < 2**15 else epoch, kind="stable")
        epoch, apps, cells, gaps, weights = (np.take(x, order) for x in (epoch, apps, cells, gaps, weights))
        epochs = np.arange(n_epochs + 1)
        begin = np.searchsorted(epoch, epochs)
        _last(last, epoch[: begin[-1]], apps[: begin[-1]], np.where(weights > 0, cells, -1)[: begin[-1]])
        h = np.flatnonzero(cells < n_heads)                     # (indices: a random mask indexes ~10x slower)
        head_keys = np.take(apps, h) * n_heads + np.take(cells, h)
        return _Piece(apps * n_cells + cells, None if np.all(weights == 1) else weights, begin, head_keys,
                      np.take(gaps, h) * np.take(weights, h), np.searchsorted(np.take(epoch, h), epochs))


def _last(last: np.ndarray, epoch: np.ndarray, apps: np.ndarray, cells: np.ndarray) -> None:
    """Into `last` (E, A): per application of these items (in order of epoch, then application), its last cell
    (with a count: the others' are -1) by each epoch."""
    if not len(apps):
        return
    lo, hi = int(apps.min()), int(apps.max()) + 1
    key = epoch * (hi - lo) + apps - lo                        # in order
    first = np.flatnonzero(key[1:] != key[:-1])
    first += 1
    first = np.concatenate([[0], first])
    part = np.full((len(last), hi - lo), -1, dtype=np.int64)
    part.reshape(-1)[key[first]] = np.maximum.reduceat(cells, first)
    np.maximum(last[:, lo:hi], np.maximum.accumulate(part, axis=0), out=last[:, lo:hi])


@dataclass(frozen=True)
class _Ended:
    """Every piece's items as one (`_Piece`), epoch after epoch (within an epoch, piece after piece): epoch e's are
    [cuts[e], cuts[e + 1]) of `keys` and `weights`, [head_cuts[e], head_cuts[e + 1]) of `head_keys` and `head_s`.
    `last` (E, A): each application's last cell with a count by each epoch (-1: none)."""

    shape: tuple[int, int, int]
    keys: np.ndarray
    weights: np.ndarray | None
    cuts: np.ndarray
    head_keys: np.ndarray
    head_s: np.ndarray
    head_cuts: np.ndarray
    last: np.ndarray

    @staticmethod
    def of(parts: Iterable[Part], shape: tuple[int, int, int], epoch_s: float, n_epochs: int) -> _Ended:
        """The items of `parts` (as `epochs_of` takes them) grouped."""
        n_apps, n_cells, _ = shape
        last = np.full((n_epochs, n_apps), -1, dtype=np.int64)
        bounds = SortedGrid.of(np.arange(n_epochs) * epoch_s)
        pieces = [_Piece.of(p, shape, bounds, last) for p in parts if len(p[0])]
        small = np.int32 if n_apps * n_cells < 2**31 else np.int64
        to, cuts = _places([pc.begin for pc in pieces], n_epochs)
        keys = _put(to, [pc.keys for pc in pieces], small)
        weights = None if all(pc.weights is None for pc in pieces) else _put(
            to, [np.ones(len(pc.keys)) if pc.weights is None else pc.weights for pc in pieces], np.float64)
        to, head_cuts = _places([pc.head_begin for pc in pieces], n_epochs)
        return _Ended(shape, keys, weights, cuts, _put(to, [pc.head_keys for pc in pieces], small),
                      _put(to, [pc.head_s for pc in pieces], np.float64), head_cuts, last)

    def so_far(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per epoch, from the periods that ended before it: per application its counts per cell (A, c), idle
        seconds per head cell (A, h) and last cell with a count (A,). The same arrays each time, updated in place."""
        n_apps, n_cells, n_heads = self.shape
        counts = np.zeros((n_apps, n_cells))
        sums = np.zeros((n_apps, n_heads))
        flat = counts.reshape(-1)
        for e in range(len(self.last)):
            lo, hi = self.cuts[e], self.cuts[e + 1]
            if hi > lo:
                # Whole numbers: the same counts in any order of additions (and only the items' cells, not all).
                np.add.at(flat, self.keys[lo:hi], 1.0 if self.weights is None else self.weights[lo:hi])
                # Seconds are not: each cell's summed in the order of their ends, each epoch's added at once.
                lo, hi = self.head_cuts[e], self.head_cuts[e + 1]
                sums += np.bincount(self.head_keys[lo:hi], weights=self.head_s[lo:hi],
                                    minlength=n_apps * n_heads).reshape(n_apps, n_heads)
            yield counts, sums, self.last[e]


def _places(begins: list[np.ndarray], n_epochs: int) -> tuple[list[np.ndarray], np.ndarray]:
    """For pieces whose epochs' items begin at `begins` (each (E + 1,)): where each piece's items go in the whole,
    epoch after epoch (each epoch's piece after piece), and where each epoch's items begin in the whole."""
    sizes = np.array([np.diff(b) for b in begins], dtype=np.int64).reshape(len(begins), n_epochs)   # (pieces, E)
    cuts = np.zeros(n_epochs + 1, dtype=np.int64)
    np.cumsum(sizes.sum(axis=0), out=cuts[1:])
    at = cuts[:-1] + np.cumsum(sizes, axis=0) - sizes              # (pieces, E) where each piece's epoch goes
    return [np.arange(b[-1]) + np.repeat(a - b[:-1], n) for a, b, n in zip(at, begins, sizes, strict=True)], cuts


def _put(to: list[np.ndarray], arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    """The pieces' `arrays` (each as long as its items' places `to`, or longer) as one, each item in its place."""
    out: np.ndarray = np.empty(sum(len(t) for t in to), dtype=dtype)
    for t, a in zip(to, arrays, strict=True):
        out[t] = a[: len(t)]
    return out


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
        mass[:, :reach] = _km_mass_by_cell(np.take(counts[:, :reach], rows, axis=0).T.copy(), censored[rows]).T
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
