"""The ladder's per-cell arithmetic: hazards, expected time held and the cheapest level of each cell.

`ember.keepalive.policies.LadderPolicy` states the decision; this module carries it out on many rows at
once. Everything works on (cells, rows) arrays: a row's cells are few, the rows many, and numpy runs
much faster along the long axis. Rows are planned in chunks small enough for the temporaries to stay
in the processor's cache, and the arithmetic runs in place where it can; each float is computed by the
same operations in the same order as the textbook expressions in the docstrings, so the plans do not
depend on how the rows are batched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ember.errors import InvalidInput
from ember.keepalive.forecast import HistoryTable
from ember.keepalive.idle_plan import COLD, ZYGOTE
from ember.keepalive.ladder_climbs import plan_climbs
from ember.keepalive.pooled_prior import PooledPrior

# Rows per chunk: a (cells, rows) float temporary of a head-only plan (9 cells) then takes ~600 KB (measured best
# of 2048 to 65536 on the development VM).
CHUNK_ROWS = 8192


@dataclass(frozen=True)
class Grid:
    """What a ladder's decision needs besides the statistics, computed once per policy and statistics spec."""

    starts: np.ndarray        # (cells,) idle time at which each cell begins
    prior: np.ndarray         # (cells - 1,) the prior's mass per in-range cell
    prior_held: np.ndarray    # (head, 1) E[min(idle, end) - start; idle >= start] per head cell under the prior
    prior_before: np.ndarray  # (head, 1) the prior's mass before each head cell
    levels: np.ndarray        # the candidate levels
    mb: np.ndarray            # idle MB per level (the zygote not included)
    per_start: np.ndarray     # MB*s charged per start from each level (`LadderPolicy.start_value`)
    heads: int                # head cells of the statistics
    bin_s: float              # the width of a later cell
    prior_weight: float       # pseudo-observations of the prior
    smooth_weight: float      # pseudo-periods at risk of the neighbourhood's hazard
    smooth_events: float      # pseudo-arrivals at the neighbourhood's hazard (Gamma-Poisson shrinkage)
    tail_excess_s: float      # the prior's mean excess beyond the range
    sub: SubCells | None = None   # finer head cells to decide at (`LadderPolicy.decide_splits`)
    rent: float = 0.0             # the zygote's break-even floor, a share of its break-even time (`rent_floor`)
    lead_s: np.ndarray | None = None   # per level, the seconds a climb from it takes (`climb_lead`; None: instant)


@dataclass(frozen=True)
class SubCells:
    """Head cells finer than the statistics': each statistics cell's chance of an arrival spread over its sub-cells
    by the prior's shape."""

    starts: np.ndarray   # (f,) where each begins
    parent: np.ndarray   # (f,) the statistics' head cell it lies in
    before: np.ndarray   # (f,) the prior's share of the parent's mass before it
    share: np.ndarray    # (f,) its share of the parent's mass
    width: np.ndarray    # (f,) seconds
    mean: np.ndarray     # (f,) E[t - start | t in it] under the prior
    divided: np.ndarray  # (f,) whether its parent is divided (else it is the parent, decided on its own figures)

    def split(self, h: np.ndarray, held_c: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(hazards, held) of the sub-cells of the first k head cells (those `in_head(k)` selects) from those cells'
        hazards `h` (k, m): given idle at the parent's start, an arrival in sub-cell f has chance h * share[f]. A
        cell not split keeps its own `held_c` (from the periods seen)."""
        f = self.in_head(k)
        parents = self.parents(k)
        hc = h[parents]
        share, before = self.share[f, None], self.before[f, None]
        alive = 1.0 - hc * before
        safe = np.maximum(alive, 1e-12)
        hf = np.where(alive > 1e-12, hc * share / safe, 1.0)
        held = (hc * share * self.mean[f, None] + (1.0 - hc * (before + share)) * self.width[f, None]) / safe
        held = np.where(alive > 1e-12, held, 0.0)
        whole = ~self.divided[f]
        held[whole] = held_c[parents[whole]]
        return np.clip(hf, 0.0, 1.0), held

    def in_head(self, k: int) -> np.ndarray:
        """Which sub-cells lie in the first k head cells."""
        return self.parent < k

    def parents(self, k: int) -> np.ndarray:
        """The statistics' head cell each sub-cell of the first k head cells lies in."""
        return self.parent[self.in_head(k)]


@dataclass(frozen=True)
class RowPrior:
    """The prior per table row where it differs between rows (a pooled prior mixed in): what `Grid`'s log-uniform
    prior gives for all rows, per prior (cell-major), and each row's prior. A chunk's rows gather theirs when
    planned: from a few priors' values, into (cells, rows) arrays as the arithmetic runs on."""

    masses: np.ndarray   # (cells - 1, P) each prior's mass per in-range cell
    helds: np.ndarray    # (heads, P) E[min(idle, end) - start; idle >= start] per head cell
    befores: np.ndarray  # (heads, P) the prior's mass before each head cell
    index: np.ndarray    # (m,) each row's prior

    def take(self, rows: np.ndarray) -> RowPrior:
        return RowPrior(self.masses, self.helds, self.befores, self.index[rows])

    def mass(self, k: int) -> np.ndarray:
        """(k, m): the first k cells' masses per row."""
        return np.take(self.masses[:k], self.index, axis=1)

    @property
    def held(self) -> np.ndarray:
        """(heads, m): E[min(idle, end) - start; idle >= start] per head cell, per row."""
        return np.take(self.helds, self.index, axis=1)

    @property
    def before(self) -> np.ndarray:
        """(heads, m): the prior's mass before each head cell, per row."""
        return np.take(self.befores, self.index, axis=1)


def row_prior(grid: Grid, prior: PooledPrior | None, weight: float) -> RowPrior | None:
    """The prior per row: `weight` of the pooled one (where it pools any application) and the rest log-uniform;
    None (the log-uniform prior alone) without a pooled one or at weight 0."""
    if prior is None or weight <= 0:
        return None
    cells = len(grid.starts)
    if prior.cells != cells:
        raise InvalidInput(f"ladder: the pooled prior has {prior.cells} cells, the ladder's grid {cells}")
    w = np.where(prior.apps > 0, weight, 0.0)[:, None]
    heads = grid.prior_held.shape[0]
    edges = grid.starts[: heads + 1]
    lo, hi = edges[:-1], edges[1:]
    head = prior.mass[:, :heads]
    before = np.cumsum(head, axis=1) - head
    held = prior.head_sums - lo * head + (hi - lo) * (1.0 - before - head)
    return RowPrior(_cell_major((1 - w) * grid.prior + w * prior.mass[:, :-1]),
                    _cell_major((1 - w) * grid.prior_held[:, 0] + w * held),
                    _cell_major((1 - w) * grid.prior_before[:, 0] + w * before), prior.index)


def _cell_major(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.T)


@dataclass
class Stats:
    """Some rows' statistics, cell-major: what one chunk's plans are computed from."""

    counts: np.ndarray        # (kk, m) idle periods per in-range cell (the head cells, then the minute bins)
    head_n: np.ndarray        # (heads, m) periods per head cell (may share memory with counts)
    head_s: np.ndarray        # (heads, m) their idle seconds
    total: np.ndarray         # (m,) every period seen
    oob: np.ndarray | None    # (m,) periods out of bounds (for the tail cell only)
    oob_excess_s: np.ndarray | None
    prior: RowPrior | None = None   # the rows' own priors (None: the grid's, for all)


def gather(table: HistoryTable, total: np.ndarray, rows: np.ndarray | slice, kk: int, tail: bool,
           prior: RowPrior | None = None) -> Stats:
    """The statistics `Stats` of table rows `rows` for the first kk cells (and the tail's with `tail`), with their
    priors `prior` (per row of `table`) if any.

    The head counts are the first rows of the cell counts (a view: read them before `hazards` consumes these)."""
    heads = table.spec.head_splits + 1
    by_head = table.head_counts.T
    rows = np.arange(by_head.shape[1])[rows] if isinstance(rows, slice) else rows
    m = len(rows)
    counts = np.empty((max(kk, heads), m))
    if by_head.dtype == counts.dtype:
        np.take(by_head, rows, axis=1, out=counts[:heads])
    else:                                               # (whole numbers kept as integers: the same floats)
        counts[:heads] = np.take(by_head, rows, axis=1)
    counts[heads:] = 0.0
    keep = np.flatnonzero((table.cols >= 1) & (table.cols < kk - heads + 1))
    if len(keep):
        counts[table.cols[keep] + heads - 1] = np.take(table.counts.T[keep], rows, axis=1)
    return Stats(counts[:kk], counts[:heads], np.take(table.head_sums.T, rows, axis=1), total[rows],
                 table.oob[rows] if tail else None, table.oob_excess_s[rows] if tail else None,
                 None if prior is None else prior.take(rows))


def cumsum_cells(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Cumulative sum over the first axis (into `out` if given). np.cumsum runs down one column at a time: for a
    few cells, or long rows, a loop of row adds (the same additions, in the same order) is faster (measured: ~4x
    at 9 cells of 8192 rows, ~10x at 249; np.cumsum wins for many cells of under ~256 rows)."""
    if len(x) > 32 and x[0].size < 256:
        return np.cumsum(x, axis=0, out=out)
    if out is None:
        out = x.copy()
    else:
        np.copyto(out, x)
    for j in range(1, len(out)):
        out[j] += out[j - 1]
    return out


def hazards(grid: Grid, st: Stats, n: int) -> np.ndarray:
    """(n, m): the chance of an arrival in each of the first n cells given idle at its start, n <= cells.

    With scale = 1 / (total + a) for a pseudo-observations of the prior: pmf = (counts + a * prior) * scale,
    alive = max(1 - cumsum(pmf) + pmf, 0) (survival to each cell's start), and the hazard of each cell
    shrunk towards its neighbourhood's (`smoothed`). The cell beyond the range (n = cells) is an exponential
    tail with the observed mean excess, prior-smoothed.
    """
    full = len(grid.starts)
    k = min(n, full - 1)
    a = grid.prior_weight
    scale = 1.0 / (st.total + a)
    pmf = st.counts                                   # consumed: (counts + a * prior) * scale, in place
    pmf += a * (grid.prior[: len(pmf), None] if st.prior is None else st.prior.mass(len(pmf)))
    pmf *= scale
    alive = cumsum_cells(pmf)                         # 1 - cumsum + pmf, at least 0, in place
    np.subtract(1.0, alive, out=alive)
    alive += pmf
    np.maximum(alive, 0.0, out=alive)
    h = smoothed(pmf, alive, grid.smooth_weight * scale, grid.smooth_events * scale, heads=grid.heads, upto=k)
    if n == full:
        assert st.oob is not None and st.oob_excess_s is not None
        excess = (st.oob_excess_s + a * grid.tail_excess_s) / (st.oob + a)
        tail = 1.0 - np.exp(-grid.bin_s / np.maximum(excess, 1e-3))
        h = np.concatenate([h, tail[None, :]], axis=0)
    return np.clip(h, 0.0, 1.0, out=h)


def smoothed(pmf: np.ndarray, alive: np.ndarray, weight: np.ndarray,
             events: np.ndarray | float = 0.0, heads: int = 0, upto: int | None = None) -> np.ndarray:
    """Per-cell hazards pmf / alive ((cells, m) arrays), each shrunk towards its neighbourhood's by `weight` (m,)
    pseudo-periods at risk and `events` (m,) pseudo-arrivals (both in the units of pmf):

        near = near_pmf / near_alive (1 where near_alive <= 1e-12),
        h = (pmf + weight * near + events) / (alive + weight + events / near) (1 where alive <= 1e-12).

    Alone, a cell nobody happened to end in has a hazard of ~0, which makes "nothing kept" free there:
    a plan with a hole (hot, nothing for a few seconds, hot again) that the next request falls into.
    Borrowing strength from the neighbours fills such holes while the history is thin. Pseudo-periods fade
    once many periods reach the cell; but a cell's own estimate is only as good as the arrivals in it (a model
    called every 20 minutes has ~1 per minute cell, and none in a third of them however many periods reach
    them), so pseudo-arrivals, the conjugate (Gamma) prior of a Poisson count, fade only once the cell has many
    arrivals of its own. The neighbourhood is the cell and the two beside it; with pseudo-arrivals, the
    narrowest of 1, 2, 4 ... 32 cells either side that holds at least as many arrivals (`near`), on its own side
    of the first `heads` cells' end: a head cell is a fraction of a second to half a bin wide, a later one a
    whole bin, and without that wall a busy model's sub-second arrivals set the hazard of cells half an hour
    out (an Azure 2021 function whose 31 idle periods all ended within 0.11 s got 0.59 a minute at 25 minutes,
    0.02 with it, and the plan at `latency_value` 1e6 kept it hot for 29 minutes after each call, not one).
    `alive` is consumed. Only the first `upto` cells' hazards are returned (default: all), from the sums over all.
    """
    upto = len(pmf) if upto is None else min(upto, len(pmf))
    if np.any(events) and 0 < heads < len(pmf):
        near = np.concatenate([_near(pmf[:heads], alive[:heads], events, min(upto, heads)),
                               _near(pmf[heads:], alive[heads:], events, max(upto - heads, 0))])
    else:
        near = _near(pmf, alive, events, upto)
    pmf, alive = pmf[:upto], alive[:upto]
    # A cell no one can reach any more (alive 0: every period seen, and the prior, ended before it)
    # gets hazard 1; the divisions there are discarded. (Nothing here is NaN: `<=` is `not >`.)
    with np.errstate(divide="ignore", invalid="ignore"):
        gone = alive <= 1e-12
        pseudo: np.ndarray | float = weight
        if np.any(events):
            pseudo = events / np.maximum(near, 1e-12)   # the pseudo-arrivals as periods at risk at that hazard
            pseudo += weight
        near *= pseudo
        near += pmf
        alive += pseudo
        near /= alive
    np.copyto(near, 1.0, where=gone)
    return near


# Half-widths, in cells, of the neighbourhoods tried for one that holds the pseudo-arrivals.
NEAR_WIDTHS = (1, 2, 4, 8, 16, 32)


def _near(pmf: np.ndarray, alive: np.ndarray, events: np.ndarray | float, upto: int | None = None) -> np.ndarray:
    """Each cell's neighbourhood hazard: the cell and one either side, or with pseudo-arrivals the narrowest of
    `NEAR_WIDTHS` holding at least `events` of pmf (the widest where none does); for the first `upto` cells."""
    upto = len(pmf) if upto is None else upto
    if np.any(events):
        near, near_alive = _widened(pmf, alive, events, upto)
    else:
        near, near_alive = pmf.copy(), alive.copy()
        near[1:] += pmf[:-1]
        near_alive[1:] += alive[:-1]
        near[:-1] += pmf[1:]
        near_alive[:-1] += alive[1:]
        near, near_alive = near[:upto], near_alive[:upto]
    with np.errstate(divide="ignore", invalid="ignore"):
        near /= near_alive
    np.copyto(near, 1.0, where=near_alive <= 1e-12)
    return near


def _widened(pmf: np.ndarray, alive: np.ndarray, events: np.ndarray | float, upto: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """The sums of pmf and alive over the first `upto` cells' narrowest neighbourhoods holding `events` (`_near`);
    the neighbourhoods span all cells (a plan's last cells rest on those past it: `gathered`)."""
    # Cumulative sums padded with their end values `pad` cells either side: a neighbourhood's sum is then one
    # difference of two slices (views), clipped at the ends as the range of cells is. A half-width of cells - 1
    # already spans every cell from every cell: wider ones (none wider than the pad) give the same sums.
    cells = len(pmf)
    pad = min(NEAR_WIDTHS[-1], max(cells - 1, 0))
    cp = np.empty((cells + 1 + 2 * pad, *pmf.shape[1:]))
    ca = np.empty_like(cp)
    cp[: pad + 1] = ca[: pad + 1] = 0.0
    cumsum_cells(pmf, out=cp[pad + 1: pad + 1 + cells])
    cumsum_cells(alive, out=ca[pad + 1: pad + 1 + cells])
    cp[pad + 1 + cells:] = cp[pad + cells]
    ca[pad + 1 + cells:] = ca[pad + cells]
    widths = sorted({min(w, pad) for w in NEAR_WIDTHS})
    near, near_alive = _window(cp, pad, widths[0], upto), _window(ca, pad, widths[0], upto)
    for k, w in enumerate(widths[1:]):
        short = near < events
        few = np.count_nonzero(short)
        if few * 8 < short.size:                      # (none: done) the rest cell by cell, on those alone
            _widen_few(near, near_alive, cp, ca, pad, widths[1 + k:], short, events)
            break
        np.copyto(near, _window(cp, pad, w, upto), where=short)
        np.copyto(near_alive, _window(ca, pad, w, upto), where=short)
    return near, near_alive


def _widen_few(near: np.ndarray, near_alive: np.ndarray, cp: np.ndarray, ca: np.ndarray, pad: int,
               widths: list[int], short: np.ndarray, events: np.ndarray | float) -> None:
    """`_widened`'s search over `widths` for the cells still `short`, in place: the same subtractions, picked."""
    at = np.flatnonzero(short)
    row, col = np.divmod(at, near[0].size)
    # Each cell's pseudo-arrivals: its row's (events per row, or one for all: no (cells, m) copy of them).
    if np.ndim(events) == 0:
        ev = np.full(len(at), events)
    elif np.shape(events) == near.shape[1:]:
        ev = np.take(np.reshape(events, -1), col)
    else:
        ev = np.broadcast_to(events, near.shape).reshape(-1)[at]
    cp, ca = cp.reshape(len(cp), -1), ca.reshape(len(ca), -1)
    flat, flat_alive = near.reshape(-1), near_alive.reshape(-1)     # (views: fresh differences)
    for w in widths:
        if not len(at):
            return
        hi, lo = row + pad + w + 1, row + pad - w
        sums = cp[hi, col] - cp[lo, col]
        flat[at], flat_alive[at] = sums, ca[hi, col] - ca[lo, col]
        still = sums < ev
        at, row, col, ev = at[still], row[still], col[still], ev[still]


def _window(cum: np.ndarray, pad: int, w: int, cells: int) -> np.ndarray:
    """The first `cells` cells' sums over the cell and w either side, from cumulative sums padded as in `_widened`."""
    return cum[pad + w + 1: pad + w + 1 + cells] - cum[pad - w: pad - w + cells]


def held_head(grid: Grid, st: Stats) -> np.ndarray:
    """(heads, m): expected seconds held in each head cell [lo, hi) given idle at lo, E[min(idle, hi) - lo | idle >=
    lo], from the periods seen there (prior-smoothed):

        held = sums - lo * n + (hi - lo) * beyond + a * prior_held,  alive = total + a - before - a * prior_before,
        held / alive (0 where alive <= 1e-12),

    with `before` the periods that ended before the cell and `beyond` = total - before - n those that outlast it.
    """
    edges = grid.starts[: grid.heads + 1, None]
    lo, hi = edges[:-1], edges[1:]
    a = grid.prior_weight
    # (Whole numbers: as floats, the same values whatever dtype the table keeps them in.)
    n, total = np.asarray(st.head_n, dtype=np.float64), np.asarray(st.total, dtype=np.float64)
    before = cumsum_cells(n)
    before -= n
    beyond = total - before
    beyond -= n
    beyond *= hi - lo
    held = st.head_s - lo * n
    held += beyond
    prior_held, prior_before = (grid.prior_held, grid.prior_before) if st.prior is None else (st.prior.held,
                                                                                              st.prior.before)
    held += a * prior_held
    alive = total + a - before
    alive -= a * prior_before
    gone = alive <= 1e-12                              # (nothing here is NaN: `<=` is `not >`)
    with np.errstate(divide="ignore", invalid="ignore"):
        held /= alive                                  # (discarded where gone)
    np.copyto(held, 0.0, where=gone)
    return held


def decide(grid: Grid, st: Stats, n: int, zprice: np.ndarray | float, per_start: np.ndarray | None = None
           ) -> np.ndarray:
    """(n, m) level codes: per cell, the candidate level of least cost(level) = mb[level] * held +
    per_start[level] * hazard; ties go to the earlier (faster) level. Every level but FETCH holds the zygote at
    `zprice` (per row, or one for all). `per_start` (levels, m): each row's charge per start, where it differs
    between rows (default: the grid's)."""
    per = grid.per_start if per_start is None else per_start
    k = min(n, grid.heads)
    head = held_head(grid, st)[:k]                      # (first: `hazards` consumes the counts)
    reached = _reached(st, n) if grid.rent > 0 else None
    h = hazards(grid, st, n)
    held = np.empty_like(h)
    held[:k] = head
    if n > k:                                          # later cells: an arrival, if any, mid-cell on average
        later = np.divide(h[k:], 2.0, out=held[k:])
        np.subtract(1.0, later, out=later)
        later *= grid.bin_s
    head_rows = k
    if grid.sub is not None:
        hf, heldf = grid.sub.split(h[:k], held[:k], k)
        h, held = np.concatenate([hf, h[k:]]), np.concatenate([heldf, held[k:]])
        head_rows = len(hf)
        if reached is not None:
            reached = np.concatenate([reached[grid.sub.parents(k)], reached[k:]])
    levels = grid.levels
    best = _cost(grid, int(levels[0]), held, h, zprice, per)
    codes = np.full(h.shape, levels[0], dtype=np.int8)
    for lv in levels[1:]:
        cost = _cost(grid, int(lv), held, h, zprice, per)
        np.copyto(codes, np.int8(lv), where=cost < best)
        np.minimum(best, cost, out=best)
    barred = None
    starts = _starts(grid, n)
    if reached is not None and ZYGOTE in levels and COLD in levels:
        barred = rent_floor(grid, codes, starts[: len(codes)], reached, held, zprice, per)
    if grid.lead_s is not None:
        _with_leads(grid, codes, starts, h, held, zprice, per, head_rows, barred)
    return codes


def _with_leads(grid: Grid, codes: np.ndarray, starts: np.ndarray, h: np.ndarray, held: np.ndarray,
                zprice: np.ndarray | float, per_start: np.ndarray, head_rows: int, barred: np.ndarray | None
                ) -> None:
    """In place: the head cells of the rows whose plan `codes` climbs there, planned again with the climbs' lead
    times (`ember.keepalive.ladder_climbs`).

    Only the head, and ending free: the head's hazards and times held depend on no later cell (its neighbourhoods
    stay on its side, `smoothed`), so neither does its plan, and a plan made for the idle periods a row will meet
    (`LadderPolicy.plans`' `need_s`) is there the plan the live node makes for all of them. (Ending on the first
    later cell's level would charge a climb into it, but that level rests on neighbourhoods up to 32 cells further.)
    `barred` (cells, m): where the zygote's rent bars FETCH (`rent_floor`), kept so here too."""
    assert grid.lead_s is not None
    span = min(head_rows, len(codes))
    rows = np.flatnonzero((codes[1:span] < codes[: span - 1]).any(axis=0))
    if not len(rows):
        return
    ends = starts[1:span + 1] if len(starts) > span else np.append(starts[1:span], starts[span - 1] + grid.bin_s)
    zp = zprice[rows] if isinstance(zprice, np.ndarray) else zprice
    ps = per_start if per_start.ndim == 1 else per_start[:, rows]
    hr, hd = h[:span, rows], held[:span, rows]
    costs = np.stack([_cost(grid, int(lv), hd, hr, zp, ps) for lv in grid.levels])
    levels = np.asarray(grid.levels)
    if barred is not None:
        costs[levels == COLD] = np.where(barred[:span, rows], np.inf, costs[levels == COLD])
    codes[:span, rows] = plan_climbs(levels, grid.lead_s, costs, hr, starts[:span], ends, ps)


def _reached(st: Stats, n: int) -> np.ndarray:
    """(n, m): the idle periods seen (not the prior's) that lasted to each of the first n cells' start (the cell
    beyond the range: those out of bounds). Read before `hazards` consumes the counts."""
    kk = min(n, len(st.counts))
    out = np.empty((n, len(st.total)))
    ended = cumsum_cells(st.counts[:kk], out=out[:kk])
    np.subtract(st.total, ended, out=ended)
    ended += st.counts[:kk]
    if n > kk:
        out[kk:] = 0.0 if st.oob is None else st.oob
    return out


def rent_floor(grid: Grid, codes: np.ndarray, starts: np.ndarray, reached: np.ndarray, held: np.ndarray,
               zprice: np.ndarray | float, per_start: np.ndarray) -> np.ndarray:
    """In place: nothing kept (FETCH) becomes the zygote in the cells the statistics cannot judge that begin
    before `rent` x the zygote's break-even time, the idle time at which holding it has cost what one start from
    it saves against a full one (per_start[FETCH] - per_start[ZYGOTE] over its MB, zygote price included).

    The ski-rental rule where the forecast is blind: per cell the expected cost decides, and FETCH wins where the
    hazard is below the break-even hazard h* = MB x held / saving. Where the periods that reached the cell (`reached`)
    would show fewer than one arrival at h* (reached x h* < 1), the statistics cannot tell a hazard below h* from one
    above it: the hazard there is the prior's and the neighbours' guess (the tail early in a model's life, or a
    drift the statistics lag), and a low guess drops the zygote before a long period's arrival, which then pays a
    whole cold start (12.5 s) where the zygote's rent is 150 MB. Held there to its break-even time, the zygote
    costs an idle period at most `rent` x one start's saving (and one cell) more than the forecast's plan; where the
    statistics can judge, the forecast decides alone. Judged cell by cell, as the decision is: a cell narrower than
    saving / (reached x MB) is blind however many periods reached it (the head's first cells, hundredths of a
    second wide, until ~1,000 periods: the zygote is then held through them, at the cost of their width), and a
    blind cell that begins before the break-even time is held whole (up to one cell's rent past it). Sub-cells
    (`decide_splits`) count the periods that reached their parent cell. Returns where it bars FETCH (cells, m)."""
    rate = grid.mb[ZYGOTE] + zprice
    saved = per_start[COLD] - per_start[ZYGOTE]
    with np.errstate(divide="ignore", invalid="ignore"):
        until = np.where(rate > 0, grid.rent * saved / rate, np.inf)
        blind = reached * rate * held < saved
    barred = (starts[:, None] < until) & blind
    np.copyto(codes, np.int8(ZYGOTE), where=(codes == COLD) & barred)
    return barred


def _cost(grid: Grid, lv: int, held: np.ndarray, h: np.ndarray, zprice: np.ndarray | float,
          per_start: np.ndarray) -> np.ndarray:
    """mb * held + per_start * h, mb the level's memory plus (but on FETCH) the zygote's price."""
    mb = grid.mb[lv] + (zprice if lv != COLD else 0.0)
    if np.ndim(mb) == 0 and mb == 0.0:                 # 0 * held + x is x (held is finite): no memory term
        return per_start[lv] * h
    cost = mb * held
    cost += per_start[lv] * h
    return cost


def _starts(grid: Grid, n: int) -> np.ndarray:
    """Where each cell `decide` gives codes for begins, for plans of n cells."""
    if grid.sub is None:
        return grid.starts
    k = min(n, grid.heads)
    return np.concatenate([grid.sub.starts[grid.sub.in_head(k)], grid.starts[k:]])


def _runs(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-cell level codes (cells, m rows) as runs of equal codes: the flat index (cell * m + row) of each run's
    first cell, in order, and its step number in its row's plan."""
    new = np.ones(codes.shape, dtype=bool)
    np.not_equal(codes[1:], codes[:-1], out=new[1:])
    at = np.flatnonzero(new)
    return at, cumsum_cells(new.astype(np.int16)).ravel()[at] - 1


def gathered(grid: Grid, n: int) -> int:
    """How many cells' statistics the hazards of the first n cells rest on: their successor too (the last cell's
    smoothing looks at it) and, with pseudo-arrivals (`smoothed`), a later cell's neighbourhood up to
    `NEAR_WIDTHS[-1]` cells either side, a head cell's anywhere in the head. With fewer, a plan asked up to a row's
    `need_s` would differ there from the whole plan the live node makes (28 of 267,192 rows of synthetic days)."""
    full = len(grid.starts)
    reach = 0
    if grid.smooth_events > 0:
        reach = NEAR_WIDTHS[-1] if n > grid.heads else grid.heads - n
    return min(min(n, full - 1) + 1 + reach, full - 1)


def plan_table(grid: Grid, table: HistoryTable, groups: list[tuple[np.ndarray, int]], zprice: np.ndarray | float,
               per_start: np.ndarray | None = None, prior: RowPrior | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Step plans for every row of `table`, each of `groups` (rows, n) planned up to its n cells: one step per run
    of equal codes, starting where the run's first cell begins. `per_start` (levels, rows) and `prior` are the
    rows' own charges per start and priors where they differ between rows. Returns (breaks, codes), each (rows,
    width), padded with +inf and FETCH (width: the most steps any plan has)."""
    full = len(grid.starts)
    total = table.total
    chunks = []
    for rows, n in groups:
        kk = gathered(grid, n)
        for lo in range(0, len(rows), CHUNK_ROWS):
            part = rows[lo:lo + CHUNK_ROWS]
            zp = zprice[part] if isinstance(zprice, np.ndarray) else zprice
            ps = None if per_start is None else per_start[:, part]
            codes = decide(grid, gather(table, total, part, kk, n == full, prior), n, zp, ps)
            chunks.append((part, codes, *_runs(codes), _starts(grid, n)))
    width = max((int(step.max()) + 1 for *_, step, _ in chunks), default=1)
    breaks = np.full((table.rows, width), np.inf)
    out = np.full((table.rows, width), COLD, dtype=np.int8)
    for part, codes, at, step, starts in chunks:
        cell = at // len(part)
        flat = part[at - cell * len(part)] * width + step
        np.put(breaks, flat, starts[cell])
        np.put(out, flat, codes.ravel()[at])
    return breaks, out


__all__ = ["CHUNK_ROWS", "Grid", "RowPrior", "Stats", "cumsum_cells", "decide", "gather", "gathered", "hazards",
           "held_head", "plan_table", "rent_floor", "row_prior", "smoothed"]
