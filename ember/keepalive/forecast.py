"""Idle-time statistics and forecasts the keep-alive policies decide from.

An application's idle times (from the end of one execution to the next arrival) go
into a range-limited histogram with fixed bins, as in "Serverless in the Wild"
(Shahrad et al., ATC 2020): 1-minute bins over 4 hours, plus an out-of-bounds count.

There are two views of the same statistics, so one policy implementation serves both
drivers: `IdleHistory` is one application's running state (the live server observes
each idle period), and `HistoryTable` holds the state at many refresh points at once
(the simulator builds it with numpy from a whole trace). A policy computes plans from a
`HistoryTable`; `IdleHistory.table()` is a one-row table.

`arima_forecast` is the time-series forecast the hybrid policy uses when an
application's idle times fall mostly out of the histogram's range: an ARIMA(p, d, 0)
model fitted by least squares: d by the KPSS stationarity test (AIC cannot compare
likelihoods of differently differenced series), then p by AIC.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ember.errors import InvalidInput

# The forecast only needs recent behaviour; older idle times are dropped.
RECENT_KEPT = 100


# The most bins a histogram may have (a day of one-second bins): each costs every history a column.
MAX_BINS = 86400


@dataclass(frozen=True)
class HistogramSpec:
    """Bins of `bin_s` seconds covering [0, range_s); longer idle times are out of bounds.

    With `head_splits` = k > 0 the first bin is also split into k + 1 head cells at
    bin_s / 2^k, ..., bin_s / 4, bin_s / 2: most idle periods of a busy application are
    seconds or less, and a policy that can only decide per minute must keep such an
    application hot for a whole minute after every request.
    """

    bin_s: float = 60.0
    range_s: float = 4 * 3600.0
    head_splits: int = 0

    def __post_init__(self) -> None:
        if not self.bin_s > 0:
            raise InvalidInput(f"histogram bin_s must be > 0, got {self.bin_s}")
        if not self.bin_s <= self.range_s <= self.bin_s * MAX_BINS:
            raise InvalidInput(f"histogram range_s must lie in [bin_s, {MAX_BINS:,} bins] ([{self.bin_s:g}, "
                               f"{self.bin_s * MAX_BINS:g}]), got {self.range_s}")
        if not 0 <= self.head_splits <= 30:
            raise InvalidInput(f"histogram head_splits must lie in [0, 30], got {self.head_splits}")

    @property
    def n_bins(self) -> int:
        return round(self.range_s / self.bin_s)

    @property
    def head_edges(self) -> np.ndarray:
        """(head_splits + 2,) edges of the head cells: 0, bin_s / 2^k, ..., bin_s / 2, bin_s."""
        k = self.head_splits
        return np.concatenate([[0.0], self.bin_s / 2.0 ** np.arange(k, -1, -1)])

    def head_of(self, idle_s: np.ndarray) -> np.ndarray:
        """Head cell per idle time (meaningful for the first bin's periods, idle_s < bin_s)."""
        cell = np.searchsorted(self.head_edges, np.maximum(idle_s, 0.0), side="right") - 1
        return np.minimum(cell, self.head_splits).astype(np.int64)

    def bin_of(self, idle_s: np.ndarray) -> np.ndarray:
        """Bin index per idle time; `n_bins` means out of bounds."""
        return np.minimum(np.floor(np.maximum(idle_s, 0.0) / self.bin_s), self.n_bins).astype(np.int64)


@dataclass
class HistoryTable:
    """Idle-time statistics at m refresh points (one row each), for vectorised planning."""

    spec: HistogramSpec
    cols: np.ndarray          # (k,) the in-range bins that ever hold a period, ascending
    counts: np.ndarray        # (m, k) idle periods per such bin (every other bin is empty)
    oob: np.ndarray           # (m,) idle periods out of bounds
    sum_s: np.ndarray         # (m,) total idle seconds (for the mean)
    oob_excess_s: np.ndarray  # (m,) total seconds beyond the range over out-of-bound periods
    head_counts: np.ndarray   # (m, h) periods per head cell of the first bin (h = head_splits + 1)
    head_sums: np.ndarray     # (m, h) their total idle seconds (sub-bin detail)
    # Recent idle times per row, oldest first: the ARIMA input. Built lazily for the rows that need it.
    _gaps: np.ndarray = field(default_factory=lambda: np.zeros(0))
    _weights: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    _ends: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def rows(self) -> int:
        return int(self.counts.shape[0])

    @property
    def in_range(self) -> np.ndarray:
        return self.counts.sum(axis=1)

    @property
    def total(self) -> np.ndarray:
        return self.in_range + self.oob

    @property
    def head_sum_s(self) -> np.ndarray:
        """(m,) total idle seconds of the periods in the first bin."""
        return self.head_sums.sum(axis=1)

    def dense(self, n: int | None = None) -> np.ndarray:
        """(m, n) counts of the first n bins (all bins by default)."""
        n = self.spec.n_bins if n is None else min(n, self.spec.n_bins)
        out = np.zeros((self.rows, n))
        keep = self.cols < n
        out[:, self.cols[keep]] = self.counts[:, keep]
        return out

    def cv(self) -> np.ndarray:
        """Coefficient of variation of the bin counts over all bins, per row (0 for an empty histogram)."""
        b = self.spec.n_bins
        mean = self.in_range / b
        if b < 2:
            return np.zeros(self.rows)
        var = np.maximum(((self.counts**2).sum(axis=1) - b * mean**2) / (b - 1), 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(mean > 0, np.sqrt(var) / mean, 0.0)

    def percentile_bins(self, rows: np.ndarray, *qs: float) -> list[np.ndarray]:
        """For the given (non-empty) rows and each q, the first bin whose cumulative share reaches q."""
        cum = np.cumsum(self.counts[rows], axis=1)
        return [self.cols[np.argmax(cum >= q * cum[:, -1:] - 1e-9, axis=1)] for q in qs]

    def recent(self, row: int, keep: int = RECENT_KEPT) -> np.ndarray:
        """The last `keep` idle times known at refresh point `row`, oldest first."""
        end = int(self._ends[row])
        start = end
        taken = 0
        while start > 0 and taken < keep:
            start -= 1
            taken += int(self._weights[start])
        seq = np.repeat(self._gaps[start:end], self._weights[start:end])
        return seq[-keep:]

    def take(self, rows: np.ndarray) -> HistoryTable:
        """A table of some of the rows (same idle-time sequence behind it)."""
        return HistoryTable(self.spec, self.cols, self.counts[rows], self.oob[rows], self.sum_s[rows],
                            self.oob_excess_s[rows], self.head_counts[rows], self.head_sums[rows], self._gaps,
                            self._weights, self._ends[rows])

    @classmethod
    def concat(cls, tables: list[HistoryTable]) -> HistoryTable:
        """One table holding every row of `tables` (same spec), for planning many applications in one call.

        Its columns are the union of theirs. It keeps no idle-time sequences: `recent` (the ARIMA input) answers
        nothing on it, so only policies that plan from the histograms alone may use it.
        """
        spec = tables[0].spec
        cols = np.unique(np.concatenate([t.cols for t in tables]))
        counts = np.zeros((sum(t.rows for t in tables), len(cols)))
        at = 0
        for t in tables:
            counts[at:at + t.rows, np.searchsorted(cols, t.cols)] = t.counts
            at += t.rows

        def stack(name: str) -> np.ndarray:
            return np.concatenate([getattr(t, name) for t in tables])

        return cls(spec, cols, counts, stack("oob"), stack("sum_s"), stack("oob_excess_s"), stack("head_counts"),
                   stack("head_sums"), _ends=np.zeros(len(counts), dtype=np.int64))

    @classmethod
    def build_many(cls, spec: HistogramSpec, parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, int]]
                   ) -> HistoryTable:
        """`concat` of `build(spec, *part)` for each part, in one numpy pass over them all (the same rows).

        Every statistic is counted into one (statistic, row) array, cell-major (the ladder reads it by cell), and
        accumulated part by part in the same order as `build`, so every row holds the very same floats.
        """
        n_rows = np.array([p[3] for p in parts], dtype=np.int64)
        first_row = np.concatenate([[0], np.cumsum(n_rows)])
        m = int(first_row[-1])
        gaps = np.concatenate([p[0] for p in parts])
        w = np.concatenate([p[1] for p in parts]).astype(np.float64)
        row = np.concatenate([p[2] for p in parts]) + np.repeat(first_row[:-1], [len(p[0]) for p in parts])
        bins = spec.bin_of(gaps)
        cols = np.flatnonzero(np.bincount(bins, minlength=spec.n_bins + 1)[:-1])
        c, h = len(cols), spec.head_splits + 1
        col_of = np.full(spec.n_bins + 1, c)                 # bin -> column; out of bounds -> column c
        col_of[cols] = np.arange(c)
        head = bins == 0
        cell = spec.head_of(gaps[head])
        oob = np.flatnonzero(gaps > spec.range_s)             # (only they have an excess: adding 0 changes no sum)
        # Statistic rows: counts per column, out of bounds, idle seconds, excess seconds, head counts, head seconds.
        head_at = (c + 3 + cell) * m + row[head]
        gw = gaps * w
        inc = np.bincount(np.concatenate([col_of[bins] * m + row, (c + 1) * m + row, (c + 2) * m + row[oob], head_at,
                                          head_at + h * m]),
                          weights=np.concatenate([w, gw, (gaps[oob] - spec.range_s) * w[oob], w[head], gw[head]]),
                          minlength=(c + 3 + 2 * h) * m).reshape(c + 3 + 2 * h, m)
        # Row s of a part holds its periods of segment < s: the running sum of its segments 0 .. s - 1.
        cum = np.empty_like(inc)
        cum[:, first_row[:-1]] = 0.0
        for lo, hi in itertools.pairwise(first_row):
            if hi - lo > 1:
                np.cumsum(inc[:, lo:hi - 1], axis=1, out=cum[:, lo + 1:hi])
        return cls(spec, cols, cum[:c].T, cum[c], cum[c + 1], cum[c + 2], cum[c + 3:c + 3 + h].T,
                   cum[c + 3 + h:].T, _ends=np.zeros(m, dtype=np.int64))

    @classmethod
    def build(cls, spec: HistogramSpec, gaps: np.ndarray, weights: np.ndarray, segs: np.ndarray,
              n_rows: int) -> HistoryTable:
        """Row s holds every idle period with segment < s (what was known at refresh point s).

        `gaps` are idle seconds, `weights` how many identical periods each stands for and
        `segs` (non-decreasing) the refresh segment in which each period began.
        """
        n_bins = spec.n_bins
        bins = spec.bin_of(gaps)
        w = weights.astype(np.float64)
        # Only the bins that ever hold a period get a column: a day of a busy app touches a few.
        cols = np.unique(bins[bins < n_bins])
        col = np.where(bins < n_bins, np.searchsorted(cols, bins), len(cols))
        row = segs + 1
        inc = _binsum(row, col, w, (n_rows + 1, len(cols) + 1))
        cum = np.cumsum(inc, axis=0)[:n_rows]
        sums = _binsum(row, 0, gaps * w, (n_rows + 1, 1))[:, 0]
        excess = _binsum(row, 0, np.maximum(gaps - spec.range_s, 0.0) * w, (n_rows + 1, 1))[:, 0]
        first = bins == 0
        cell = spec.head_of(gaps[first])
        head_n = _binsum(row[first], cell, w[first], (n_rows + 1, spec.head_splits + 1))
        head_s = _binsum(row[first], cell, gaps[first] * w[first], (n_rows + 1, spec.head_splits + 1))
        ends = np.searchsorted(segs, np.arange(n_rows), side="left")
        return cls(spec, cols, cum[:, :-1], cum[:, -1], np.cumsum(sums)[:n_rows],
                   np.cumsum(excess)[:n_rows], np.cumsum(head_n, axis=0)[:n_rows], np.cumsum(head_s, axis=0)[:n_rows],
                   gaps, weights.astype(np.int64), ends)


def _binsum(rows: np.ndarray, cols: np.ndarray | int, weights: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """A (rows, cols) array of the weights summed per cell (np.add.at, but several times faster)."""
    flat = np.bincount(rows * shape[1] + cols, weights=weights, minlength=shape[0] * shape[1])
    return flat.reshape(shape)


class IdleHistory:
    """One application's idle-time statistics, updated as idle periods end (the live driver)."""

    def __init__(self, spec: HistogramSpec | None = None) -> None:
        self.spec = spec or HistogramSpec()
        self.counts = np.zeros(self.spec.n_bins)
        self.oob = 0.0
        self.sum_s = 0.0
        self.oob_excess_s = 0.0
        self.head_counts = np.zeros(self.spec.head_splits + 1)
        self.head_sums = np.zeros(self.spec.head_splits + 1)
        self._recent: deque[float] = deque(maxlen=RECENT_KEPT)

    def observe(self, idle_s: float, weight: int = 1) -> None:
        """Record `weight` idle periods of `idle_s` seconds (negative means overlapping: zero)."""
        if not np.isfinite(idle_s):
            raise InvalidInput(f"idle time must be finite, got {idle_s}")
        idle = max(0.0, float(idle_s))
        b = int(self.spec.bin_of(np.array([idle]))[0])
        if b == 0:
            cell = int(self.spec.head_of(np.array([idle]))[0])
            self.head_counts[cell] += weight
            self.head_sums[cell] += idle * weight
        if b < self.spec.n_bins:
            self.counts[b] += weight
        else:
            self.oob += weight
            self.oob_excess_s += (idle - self.spec.range_s) * weight
        self.sum_s += idle * weight
        self._recent.extend([idle] * min(weight, RECENT_KEPT))

    @property
    def total(self) -> float:
        return float(self.counts.sum() + self.oob)

    def table(self) -> HistoryTable:
        recent = np.array(self._recent, dtype=np.float64)
        cols = np.flatnonzero(self.counts)
        return HistoryTable(self.spec, cols, self.counts[None, cols], np.array([self.oob]), np.array([self.sum_s]),
                            np.array([self.oob_excess_s]), self.head_counts[None, :].copy(),
                            self.head_sums[None, :].copy(), recent,
                            np.ones(len(recent), dtype=np.int64), np.array([len(recent)]))


def _fit_ar(series: np.ndarray, p: int) -> tuple[np.ndarray, float] | None:
    """Least-squares AR(p) with intercept; returns (coefficients, residual variance)."""
    n = len(series) - p
    if n < p + 2:
        return None
    cols = [np.ones(n)] + [series[p - k - 1: p - k - 1 + n] for k in range(p)]
    x = np.column_stack(cols)
    y = series[p:]
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ coef
    return coef, float(resid @ resid) / n


# KPSS level-stationarity test at 5% (Kwiatkowski, Phillips, Schmidt and Shin 1992, table 1).
KPSS_CRITICAL_5PCT = 0.463


def kpss_statistic(series: np.ndarray) -> float:
    """The KPSS statistic for level stationarity: sum of squared partial sums of the demeaned series over
    n^2 times the long-run variance (Newey-West, Bartlett weights, lag floor(4 (n / 100)^(1/4)))."""
    x = np.asarray(series, dtype=np.float64)
    n = len(x)
    e = x - x.mean()
    partial = np.cumsum(e)
    lags = min(n - 1, int(4 * (n / 100.0) ** 0.25))
    lrv = float(e @ e) / n
    for k in range(1, lags + 1):
        lrv += 2.0 * (1.0 - k / (lags + 1.0)) * float(e[k:] @ e[:-k]) / n
    if lrv <= 1e-12 * max(1.0, float(np.abs(x).max()) ** 2):
        return 0.0   # a constant series is stationary
    return float(partial @ partial) / (n * n * lrv)


def differencing_order(series: np.ndarray, max_d: int = 1) -> int:
    """The differencing order d: the smallest d <= max_d whose d-differenced series the KPSS test does not
    reject as level-stationary at 5% (the rule of R's forecast::ndiffs, which auto.arima uses).

    AIC cannot choose d: the likelihoods of x and of diff(x) are of different data (one point fewer,
    another scale), so comparing them is meaningless; d is chosen first, then p by AIC within it.
    """
    z = np.asarray(series, dtype=np.float64)
    for d in range(max_d):
        if len(z) < 4 or kpss_statistic(z) < KPSS_CRITICAL_5PCT:
            return d
        z = np.diff(z)
    return max_d


def arima_order(series: np.ndarray, max_p: int = 2, max_d: int = 1) -> tuple[int, int]:
    """(p, d): d by the KPSS rule (`differencing_order`), then p <= max_p by AIC on the d-differenced series
    (every candidate p fitted on the same last len - max_p points, so the AICs compare like with like)."""
    x = np.asarray(series, dtype=np.float64)
    d = differencing_order(x, max_d)
    z = np.diff(x, n=d) if d else x
    best: tuple[float, int] | None = None
    for p in range(max_p + 1):
        fit = _fit_ar(z[max_p - p:], p)
        if fit is None:
            continue
        _, var = fit
        n = len(z) - max_p
        aic = n * np.log(max(var, 1e-12)) + 2 * (p + 1)
        if best is None or aic < best[0] - 1e-9:
            best = (float(aic), p)
    return (best[1] if best is not None else 0), d


def arima_forecast(series: np.ndarray, max_p: int = 2, max_d: int = 1) -> float:
    """One-step forecast of the next value by ARIMA(p, d, 0) with (p, d) from `arima_order`.

    Falls back to the last value with fewer than 4 points. The forecast is never negative.
    """
    x = np.asarray(series, dtype=np.float64)
    if len(x) == 0:
        raise InvalidInput("arima_forecast needs at least one value")
    if len(x) < 4:
        return float(max(0.0, x[-1]))
    p, d = arima_order(x, max_p, max_d)
    z = np.diff(x, n=d) if d else x
    fit = _fit_ar(z, p)
    if fit is None:
        return float(max(0.0, x[-1]))
    coef = fit[0]
    nxt = coef[0] + sum(coef[k + 1] * z[-k - 1] for k in range(p))
    pred = nxt + x[-1] if d == 1 else nxt
    return float(max(0.0, pred))
