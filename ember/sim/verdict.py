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
