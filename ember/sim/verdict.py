"""The held-out verdict: which ladder points a baseline dominates, and who wins at matched memory.

Pure functions over points (mappings of metric name to value, lower is better for every
metric used here), so the claims can be checked by hand on tiny frontiers:

- `dominators(point, others, keys)`: the points of `others` no worse than `point` on every key
  and strictly better on one (with a relative tolerance, so float noise is not a win).
- `dominated(ladder, baseline, keys)`: every ladder point some baseline point dominates, and by whom;
  `to_shed(point, by)` the share of its idle memory beyond which, shed, such a point is dominated by none.
- `matched(ladder, other, metric)`: at the memory of every point of either policy (a budget),
  each policy's best `metric` among its points with no more idle memory; the ladder wins a
  budget when its best is strictly lower (a policy with no point within a budget loses it).
- `frontier_area(points, budgets, metric, worst)`: the mean over log-spaced memory budgets of
  log10(best metric within the budget) (`worst` where none fits), the tuning objective's area.
- `among(policies, keys)`: per policy, how many of its points the other policies' points dominate: whether the
  first target could be met by any of them on a trace (a baseline held to the ladder's standard).
- `own_objective(ladder, baselines, more)`: at each ladder point's latency value V, its own objective, idle MB*s
  + V x the total start latency, against the lowest any baseline point reaches at the same V, and any point at
  all (`more`: the ladder's other points, of both sweeps): a point can be undominated (lower on one metric)
  and still far from the trade the operator asked for, or dominated by a hair and nearly the best at it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

IDLE = "idle_mb_s"
# The metric pairs: the ATC'20 pair (per-app cold-start share at the 75th percentile against wasted
# memory time), and the start-latency pair (mean and p99 against idle memory, jointly).
PAIRS: dict[str, tuple[str, ...]] = {
    "atc": (IDLE, "app_cold_start_p75"),
    "latency": (IDLE, "latency_mean_s", "latency_p99_s"),
}
# Diagnostics beside the pairs: each latency against memory alone.
DIAGNOSTIC_PAIRS: dict[str, tuple[str, ...]] = {
    "mean": (IDLE, "latency_mean_s"),
    "p99": (IDLE, "latency_p99_s"),
}
REL_TOL = 1e-9

Point = Mapping[str, Any]


def _le(a: float, b: float) -> bool:
    return a <= b + REL_TOL * max(abs(a), abs(b), 1e-12)


def _lt(a: float, b: float) -> bool:
    return not _le(b, a)


def dominates(a: Point, b: Point, keys: Sequence[str]) -> bool:
    """a is no worse than b on every key and strictly better on at least one."""
    return all(_le(a[k], b[k]) for k in keys) and any(_lt(a[k], b[k]) for k in keys)


def dominators(point: Point, others: Sequence[Point], keys: Sequence[str]) -> list[Point]:
    return [o for o in others if dominates(o, point, keys)]


def dominated(ladder: Sequence[Point], baseline: Sequence[Point], keys: Sequence[str]) -> list[tuple[Point, Point]]:
    """(ladder point, one dominating baseline point) for each dominated ladder point, in the ladder's order.

    The dominator reported is the one with the least idle memory among those dominating the point."""
    out = []
    for p in ladder:
        by = dominators(p, baseline, keys)
        if by:
            out.append((p, min(by, key=lambda o: (o[IDLE], *(o[k] for k in keys)))))
    return out


def to_shed(point: Point, by: Point) -> float:
    """The share of `point`'s idle memory beyond which, shed with all else equal, no point dominates it, given `by`,
    the least memory among those that do (`dominated`'s): 1 - by's / its own. A point must shed more than that (at
    exactly by's memory, by still dominates it where better on another metric), beyond the tolerance of `_le`. A
    dominator with as much memory gives 0 (any saving beyond the tolerance lifts the point); a point that holds no
    memory has none to shed, and gets 1."""
    mine = float(point[IDLE])
    return max(0.0, 1.0 - float(by[IDLE]) / mine) if mine > 0 else 1.0


def among(policies: Mapping[str, Sequence[Point]], keys: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Per policy, (its points some other policy's point dominates, its points): each held to the standard the
    ladder is held to against them all."""
    out = {}
    for name, points in policies.items():
        others = [p for other, pts in policies.items() if other != name for p in pts]
        out[name] = (len(dominated(points, others, keys)), len(points))
    return out


def best_within(points: Sequence[Point], budget: float, metric: str) -> Point | None:
    """The point with the lowest `metric` among those with no more idle memory than `budget` (None if none)."""
    fit = [p for p in points if _le(p[IDLE], budget)]
    return min(fit, key=lambda p: (p[metric], p[IDLE])) if fit else None


def matched(ladder: Sequence[Point], other: Sequence[Point], metric: str) -> list[dict[str, Any]]:
    """One row per budget (the idle memory of every point of either policy, each once), cheapest first."""
    budgets = sorted({float(p[IDLE]) for p in [*ladder, *other]})
    rows = []
    for b in budgets:
        mine, theirs = best_within(ladder, b, metric), best_within(other, b, metric)
        if mine is None:
            outcome = "loss"
        elif theirs is None or _lt(mine[metric], theirs[metric]):
            outcome = "win"
        elif _lt(theirs[metric], mine[metric]):
            outcome = "loss"
        else:
            outcome = "tie"
        rows.append({"budget_mb_s": b, "ladder": None if mine is None else float(mine[metric]),
                     "other": None if theirs is None else float(theirs[metric]), "outcome": outcome})
    return rows


def wins(rows: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """(budgets the ladder wins, budgets in all)."""
    return sum(r["outcome"] == "win" for r in rows), len(rows)


def own_objective(ladder: Sequence[Point], baselines: Sequence[Point], more: Sequence[Point] = ()
                  ) -> list[dict[str, Any]]:
    """Per ladder point (knob `knob_value` = V, MB*s per second of start latency): its cost, idle MB*s + V x mean
    start latency x invocations; the lowest cost of the `baselines` at the same V, whose, and the ladder's excess
    over it (<= 0: the ladder's is lowest); and the same over every point but itself (`baselines`, `ladder` and
    `more`). Points whose cost is not a finite number are left out."""
    rows = []
    for p in ladder:
        v = float(p["knob_value"])

        def cost(q: Point, v: float = v) -> float:
            return float(q[IDLE]) + v * float(q["latency_mean_s"]) * float(q["invocations"])

        mine = cost(p)
        base = _cheapest(baselines, cost)
        every = _cheapest([q for q in [*baselines, *ladder, *more] if q is not p], cost)
        rows.append({"value": v, "ladder": mine, "best_other": base[1], "by": base[0], "excess": _excess(mine, base[1]),
                     "best_any": every[1], "by_any": every[0], "excess_any": _excess(mine, every[1])})
    return rows


def _cheapest(points: Sequence[Point], cost: Any) -> tuple[str | None, float | None]:
    costs = [(c, q) for q in points if np.isfinite(c := cost(q))]
    if not costs:
        return None, None
    c, q = min(costs, key=lambda cq: cq[0])
    return q.get("label"), c


def _excess(mine: float, best: float | None) -> float:
    """mine / best - 1 (0 where there is no best, or both are 0)."""
    if best is None or (best <= 0 and mine <= 0):
        return 0.0
    return mine / best - 1.0 if best > 0 else float("inf")


def frontier_area(points: Sequence[Point], budgets: np.ndarray, metric: str, worst: float) -> float:
    """Mean over `budgets` of log10(the best `metric` within each budget), `worst` where no point fits."""
    vals = []
    for b in budgets:
        p = best_within(points, float(b), metric)
        vals.append(np.log10(max(float(p[metric]) if p is not None else worst, 1e-9)))
    return float(np.mean(vals)) if vals else 0.0


# --- The envelope yardstick (issue 30): envelopes, pooled baselines, epsilon with delta, geometric-mean saving ---
#
# A policy's points are judged by their envelope, not one by one: F_S(c), the least idle memory of a point of S
# whose quality (cold share, or start latency; lower is better) is at most c. For each Pareto point b of the
# baselines' pool with an unsaturated quality, the ladder's gap is eps(b) = F_ladder(q(b) + delta(b)) / mem(b) - 1,
# and the geometric mean of F_baselines / F_ladder over 40 log-spaced quality levels inside both envelopes says how
# much memory the ladder saves across the range, with a bootstrap interval over applications.

END_RULES = ("charged", "excluded")       # idle time after each application's last call: charged to the horizon, or not
ENVELOPE_PAIRS = ("atc", "latency", "p99")
LEVELS_N = 40
ATC_BAND = (0.20, 0.90)                   # the ATC pair's saving is judged at p75 cold shares in this band
LATENCY_DELTA = 0.005                     # the latency pairs' delta: 0.5% of the baseline point's quality
FLOOR_MARGIN = 0.01                       # a latency within 1% of the all-hot floor is saturated


@dataclass(frozen=True)
class AppFigures:
    """One swept point of one policy, per application (every point lists the same applications in one order).

    `mem`: per end rule (`END_RULES`), each application's idle MB*s: its own idle memory plus its share of its
    runtime's zygote (the zygote's union charge split over the models holding it, in proportion to their holds).
    `starts`: (apps, levels) starts per level with each application's compulsory first start left out.
    `cold`: each application's share of its starts that needed a new process, its first included (ATC'20's)."""

    policy: str
    label: str
    mem: Mapping[str, np.ndarray]
    starts: np.ndarray
    cold: np.ndarray
    invocations: np.ndarray


class Stack:
    """Many points' per-application figures as (points, apps) arrays, to score them under application weights."""

    def __init__(self, points: Sequence[AppFigures], start_s: np.ndarray, rule: str) -> None:
        self.points = list(points)
        self.start_s = np.asarray(start_s, dtype=np.float64)
        self.mem = np.stack([p.mem[rule] for p in points]).astype(np.float64)
        self.starts = np.stack([p.starts for p in points]).astype(np.float64)       # (P, A, L)
        self.lat = self.starts @ self.start_s                                        # (P, A) seconds
        self.n = self.starts.sum(axis=2)                                             # (P, A)
        cold = np.stack([p.cold for p in points]).astype(np.float64)
        self.order = np.argsort(cold, axis=1, kind="stable")
        self.cold_sorted = np.take_along_axis(cold, self.order, axis=1)
        self.invocations = np.stack([p.invocations for p in points]).astype(np.float64)

    def memory(self, w: np.ndarray) -> np.ndarray:
        return self.mem @ w

    def quality(self, pair: str, w: np.ndarray) -> np.ndarray:
        if pair == "atc":
            return weighted_percentile(self.cold_sorted, np.asarray(w, dtype=np.float64)[self.order], 0.75)
        if pair == "latency":
            return (self.lat @ w) / np.maximum(self.n @ w, 1.0)
        if pair == "p99":
            return level_quantiles(np.einsum("pal,a->pl", self.starts, w), self.start_s, 0.99)
        raise ValueError(f"unknown pair {pair!r}")

    def delta(self, pair: str, q: np.ndarray, w: np.ndarray) -> np.ndarray:
        """Per point, the quality slack the ladder is given at it: one start of its p75 application (ATC), or 0.5%
        of its quality (the latency pairs)."""
        if pair != "atc":
            return LATENCY_DELTA * q
        ws = np.asarray(w, dtype=np.float64)[self.order]
        inv = np.take_along_axis(self.invocations, self.order, axis=1)
        idx = _rank_index(ws, 0.75)
        return 1.0 / np.maximum(inv[np.arange(len(idx)), idx], 1.0)


def _rank_index(ws: np.ndarray, pct: float) -> np.ndarray:
    """Per row, the index (into the sorted row) of the element at the nearest rank round(pct x (n - 1)) of the
    weighted (expanded) sample."""
    n = ws.sum(axis=1)
    k = np.rint(pct * (n - 1))
    cum = np.cumsum(ws, axis=1)
    return np.minimum((cum <= k[:, None]).sum(axis=1), ws.shape[1] - 1)


def weighted_percentile(sorted_vals: np.ndarray, ws: np.ndarray, pct: float) -> np.ndarray:
    """Per row of `sorted_vals` (ascending), numpy's linear percentile of the sample holding each value `ws` times
    (whole weights: a bootstrap resample's counts)."""
    n = ws.sum(axis=1)
    pos = pct * np.maximum(n - 1, 0)
    lo, frac = np.floor(pos), pos - np.floor(pos)
    cum = np.cumsum(ws, axis=1)
    last = sorted_vals.shape[1] - 1
    i_lo = np.minimum((cum <= lo[:, None]).sum(axis=1), last)
    i_hi = np.minimum((cum <= (lo + 1)[:, None]).sum(axis=1), last)
    rows = np.arange(sorted_vals.shape[0])
    a, b = sorted_vals[rows, i_lo], sorted_vals[rows, i_hi]
    return np.where(frac > 0, a + frac * (b - a), a)


def level_quantile(starts: np.ndarray, start_s: np.ndarray, q: float) -> float:
    """The q-quantile of start latency over starts counted per level (`RunResult.latency_quantile`'s rule)."""
    order = np.argsort(start_s, kind="stable")
    cum = np.cumsum(starts[order])
    if cum[-1] <= 0:
        return 0.0
    return float(start_s[order][np.searchsorted(cum, q * cum[-1] - 1e-9)])


def level_quantiles(starts: np.ndarray, start_s: np.ndarray, q: float) -> np.ndarray:
    """`level_quantile` of each row of `starts` (points, levels)."""
    order = np.argsort(start_s, kind="stable")
    cum = np.cumsum(starts[:, order], axis=1)
    i = (cum < (q * cum[:, -1:] - 1e-9)).sum(axis=1)
    return np.where(cum[:, -1] > 0, start_s[order][np.minimum(i, len(order) - 1)], 0.0)


def envelope(q: np.ndarray, m: np.ndarray, c: np.ndarray) -> np.ndarray:
    """F(c): per level c, the least memory `m` among points whose quality `q` is at most c (inf where none is)."""
    q, m, c = np.asarray(q, dtype=np.float64), np.asarray(m, dtype=np.float64), np.atleast_1d(c).astype(np.float64)
    if not len(q):
        return np.full(len(c), np.inf)
    order = np.argsort(q, kind="stable")
    best = np.minimum.accumulate(m[order])
    i = np.searchsorted(q[order], c * (1 + REL_TOL) + 1e-15, side="right") - 1
    return np.where(i >= 0, best[np.maximum(i, 0)], np.inf)


def pareto(q: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Indices of the points no other point beats: none has quality and memory both no worse, one strictly better
    (of equal points, the first)."""
    order = np.lexsort((np.asarray(m), np.asarray(q)))
    keep, best = [], np.inf
    for i in order:
        if m[i] < best * (1 - REL_TOL) - 1e-15:
            keep.append(int(i))
            best = m[i]
    return np.array(sorted(keep), dtype=np.int64)


def unsaturated(pair: str, q: np.ndarray, start_s: np.ndarray) -> np.ndarray:
    """Points whose quality can still be traded: a p75 cold share strictly between 0 and 1 (ATC pair); a latency
    more than 1% above the all-hot floor (and, p99, below a full cold start)."""
    q = np.asarray(q, dtype=np.float64)
    if pair == "atc":
        return (q > 0) & (q < 1)
    floor = float(np.min(start_s))
    ok = q > floor * (1 + FLOOR_MARGIN)
    return ok & (q < float(np.max(start_s))) if pair == "p99" else ok


def eps(ladder_q: np.ndarray, ladder_m: np.ndarray, base_q: np.ndarray, base_m: np.ndarray, delta: np.ndarray,
        mask: np.ndarray) -> np.ndarray:
    """Per baseline Pareto point b (in `mask`): F_ladder(q(b) + delta(b)) / mem(b) - 1 (NaN outside: not judged;
    inf where the ladder has no point that good)."""
    out = np.full(len(base_q), np.nan)
    front = pareto(base_q, base_m)
    judged = front[mask[front]]
    if len(judged):
        f = envelope(ladder_q, ladder_m, base_q[judged] + delta[judged])
        m = base_m[judged]
        with np.errstate(divide="ignore", invalid="ignore"):
            out[judged] = np.where(m > 0, f / m - 1.0, np.where(f > 0, np.inf, 0.0))
    return out


def levels(pair: str, ladder_q: np.ndarray, base_q: np.ndarray, start_s: np.ndarray, n: int = LEVELS_N,
           band: bool = True) -> np.ndarray:
    """`n` log-spaced qualities inside both envelopes: from the larger of the two sets' least unsaturated quality
    to the smaller of their greatest (for the ATC pair within `ATC_BAND` too); none where that range is empty."""
    lo_hi = []
    for q in (ladder_q, base_q):
        ok = np.asarray(q)[unsaturated(pair, q, start_s)]
        if not len(ok):
            return np.zeros(0)
        lo_hi.append((float(ok.min()), float(ok.max())))
    lo, hi = max(x[0] for x in lo_hi), min(x[1] for x in lo_hi)
    if pair == "atc" and band:
        lo, hi = max(lo, ATC_BAND[0]), min(hi, ATC_BAND[1])
    if not (0 < lo < hi):
        return np.zeros(0)
    return np.geomspace(lo, hi, n)


def geo_ratio(ladder_q: np.ndarray, ladder_m: np.ndarray, base_q: np.ndarray, base_m: np.ndarray,
              at: np.ndarray) -> float:
    """The geometric mean over the levels `at` of F_baselines(c) / F_ladder(c) (NaN with no level)."""
    if not len(at):
        return float("nan")
    fb, fl = envelope(base_q, base_m, at), envelope(ladder_q, ladder_m, at)
    tiny = 1e-9
    return float(np.exp(np.mean(np.log(np.maximum(fb, tiny)) - np.log(np.maximum(fl, tiny)))))


def judge_pair(ladder: Stack, base: Stack, pair: str, *, resamples: int = 200, seed: int = 0) -> dict[str, Any]:
    """max eps over the baselines' unsaturated Pareto points, and the geometric-mean saving 1 - F_ladder/F_base
    (from the ratio's geometric mean) with its 95% bootstrap interval over applications."""
    apps = ladder.mem.shape[1]
    w = np.ones(apps)
    lq, lm, bq, bm = ladder.quality(pair, w), ladder.memory(w), base.quality(pair, w), base.memory(w)
    e = eps(lq, lm, bq, bm, base.delta(pair, bq, w), unsaturated(pair, bq, ladder.start_s))
    judged = np.flatnonzero(~np.isnan(e))
    worst = int(judged[np.argmax(e[judged])]) if len(judged) else None
    at = levels(pair, lq, bq, ladder.start_s)
    ratio = geo_ratio(lq, lm, bq, bm, at)
    rng = np.random.default_rng(seed)
    boot = []
    for _ in range(resamples if len(at) else 0):
        wb = np.bincount(rng.integers(0, apps, apps), minlength=apps).astype(np.float64)
        lqb, bqb = ladder.quality(pair, wb), base.quality(pair, wb)
        r = geo_ratio(lqb, ladder.memory(wb), bqb, base.memory(wb), levels(pair, lqb, bqb, ladder.start_s))
        if np.isfinite(r) and r > 0:
            boot.append(1.0 - 1.0 / r)
    lo_hi = np.percentile(boot, [2.5, 97.5]) if len(boot) >= 10 else (float("nan"), float("nan"))
    reached = worst is None or bool(np.isfinite(e[worst]))
    return {"max_eps": float(e[worst]) if worst is not None and reached else None,
            "ladder_reaches": reached,          # False: some judged point is better than any ladder point (eps inf)
            "worst_point": base.points[worst].label if worst is not None else None,
            "judged": len(judged), "over_1pct": int((e[judged] > 0.01).sum()),
            "geo_saving": 1.0 - 1.0 / ratio if np.isfinite(ratio) and ratio > 0 else None,
            "ci_low": float(lo_hi[0]) if len(boot) >= 10 else None,
            "ci_high": float(lo_hi[1]) if len(boot) >= 10 else None,
            "levels": [float(at[0]), float(at[-1])] if len(at) else None, "resamples": len(boot),
            # The ATC pair outside its band too: over the whole range both envelopes span (no interval).
            "geo_saving_any_band": _saving(geo_ratio(lq, lm, bq, bm, levels(pair, lq, bq, ladder.start_s, band=False)))}


def _saving(ratio: float) -> float | None:
    return 1.0 - 1.0 / ratio if np.isfinite(ratio) and ratio > 0 else None
