"""`ember sim --verdict`: every policy's sweep on one trace, judged by the envelope yardstick (`ember.sim.verdict`).

Baselines get their real knobs (issue 30, section 2): fixed and fixed-zygote from 1 s to 2 h; hybrid and
hybrid-zygote over the range and ATC'20's head and tail percentiles; RainbowCake over its latency value and the
quantile its timers rest on; FaaSCache over the node's memory budget. Every baseline starts a model from the
zygote where the live server keeps it up (the engines' `found_up`; FaaSCache's node never lets it go). The ladder
is every point of the ladder's sweeps (`ladder`, and `ladder-cold`, its sweep along the ATC objective): the
operator picks the objective, and a ladder point its own sweep beats does not count against it.

Each point is simulated once; the two end rules are two accountings of the same run: idle memory after each
application's last execution charged up to the end of the trace, or left out (its own idle memory in that
trailing period, and its hold on its runtime's zygote from then on).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ember.core.rung_costs import RungCosts
from ember.keepalive.idle_plan import COLD
from ember.keepalive.policies import (
    FixedKeepAlive,
    FixedZygote,
    HybridHistogram,
    HybridZygote,
    LadderCold,
    LadderPolicy,
)
from ember.sim.engine import AppItems, RunResult, app_items, simulate
from ember.sim.greedy_dual import FaaSCache
from ember.sim.keepalive_layered import RainbowCake
from ember.sim.shared_engine import simulate_shared
from ember.sim.traces import Trace
from ember.sim.verdict import END_RULES, ENVELOPE_PAIRS, AppFigures, Stack, judge_pair
from ember.sim.zygotes import Holding, held_s, union_s, until

# ATC'20's percentile knobs for hybrid: the paper's (5, 99), and tighter and looser windows around it.
HYBRID_PERCENTILES = ((5.0, 99.0), (1.0, 99.0), (5.0, 95.0), (10.0, 90.0), (0.0, 99.9))
RAINBOWCAKE_QUANTILES = (0.9, 0.99, 0.999)
BASELINES = ("fixed", "fixed-zygote", "hybrid", "hybrid-zygote", "rainbowcake", "faascache")
LADDERS = ("ladder", "ladder-cold")
Policy = Any


def variants(name: str, costs: RungCosts, zygote_share: float, ladder: LadderPolicy | None = None
             ) -> list[tuple[str, Policy]]:
    """(label, policy) of every point a policy is judged at: its knob's sweep, times its other real knobs."""
    share = max(1.0, zygote_share)
    if name in ("fixed", "fixed-zygote"):
        fixed = FixedKeepAlive() if name == "fixed" else FixedZygote()
        return [(f"{name} {v:g}s", fixed.with_knob(v)) for v in fixed.sweep()]
    if name in ("hybrid", "hybrid-zygote"):
        hybrid = HybridHistogram() if name == "hybrid" else HybridZygote()
        return [(f"{name} {v / 3600:g}h p{lo:g}-{hi:g}", replace(hybrid, range_s=v, head_pct=lo, tail_pct=hi))
                for lo, hi in HYBRID_PERCENTILES for v in hybrid.sweep()]
    if name == "rainbowcake":
        cake = RainbowCake(costs=costs, zygote_share=share)
        return [(f"rainbowcake V{v:.3g} q{q:g}", replace(cake, latency_value=v, quantile=q))
                for q in RAINBOWCAKE_QUANTILES for v in cake.sweep()]
    if name == "faascache":
        cache = FaaSCache()
        return [(f"faascache {v:.3g}GB", cache.with_knob(v)) for v in _denser(cache.sweep())]
    if name in LADDERS:
        base = ladder if ladder is not None else LadderPolicy()
        lad: LadderPolicy = base if name == "ladder" else LadderCold(**_fields(base))
        lad = replace(lad, costs=costs, zygote_share=share)
        return [(f"{name} {lad.knob}={v:.3g}", lad.with_knob(v)) for v in _denser(lad.sweep())]
    raise ValueError(f"unknown policy {name!r}")


def _denser(sweep: Sequence[float]) -> list[float]:
    """A geometric sweep with the geometric mean of each neighbouring pair added: the envelopes are step functions
    between points, so a sparse sweep loses where a point of the other side falls just short of one of its own (the
    ladder's two sweeps, and FaaSCache's budgets, the baseline whose knob is as continuous)."""
    v = np.asarray(sorted(sweep), dtype=np.float64)
    mid = np.sqrt(v[1:] * v[:-1])
    return [float(x) for x in np.sort(np.concatenate([v, mid]))]


def _fields(policy: LadderPolicy) -> dict[str, Any]:
    """A ladder's constants (not its objective's knobs), to build its ATC-objective twin from."""
    from dataclasses import fields

    skip = ("latency_value", "cold_value", "cold_per_app")
    return {f.name: getattr(policy, f.name) for f in fields(policy) if f.init and f.name not in skip}


def run_point(trace: Trace, policy: Policy, costs: RungCosts, runtimes: int, items: list[AppItems]) -> RunResult:
    if isinstance(policy, FaaSCache):
        return simulate_shared(trace, policy, costs, runtimes=runtimes, per_app=True)
    return simulate(trace, policy, costs, runtimes=runtimes, items=items, per_app=True)


def figures(trace: Trace, result: RunResult, items: list[AppItems], costs: RungCosts, runtimes: int,
            policy: str, label: str) -> AppFigures:
    """One run's per-application figures under both end rules (the applications with arrivals, in trace order)."""
    active = sorted(result.apps)
    own = costs.own_mb()
    zyg_mb = costs.zygote.idle_mb
    starts = np.array([result.apps[i][0] for i in active], dtype=np.float64)
    inv = np.array([items[i].invocations for i in active], dtype=np.float64)
    cold = starts[:, 2:].sum(axis=1) / np.maximum(inv, 1)
    starts[:, COLD] -= 1                          # each application's compulsory first start
    mem: dict[str, np.ndarray] = {}
    for rule in END_RULES:
        holds: list[Holding] = []
        own_mb = np.zeros(len(active))
        for k, i in enumerate(active):
            _, idle, hold = result.apps[i]
            if rule == "excluded":
                idle = idle - hold.tail_s
                hold = until(hold, items[i].trailing_at, trace.horizon_s)
            own_mb[k] = float(np.maximum(idle, 0.0) @ own)
            holds.append(hold)
        mem[rule] = own_mb + _zygote_shares(holds, [i % runtimes for i in active], trace.horizon_s) * zyg_mb
    return AppFigures(policy, label, mem, starts, cold, inv)


def _zygote_shares(holds: Sequence[Holding], runtime: Sequence[int], horizon_s: float) -> np.ndarray:
    """Per model, its share of its runtime's zygote seconds (the union of its models' holds), in proportion to its
    own hold."""
    out = np.zeros(len(holds))
    rt = np.asarray(runtime)
    for r in np.unique(rt):
        idx = [int(i) for i in np.flatnonzero(rt == r)]
        total = union_s([holds[i] for i in idx], horizon_s)
        own = np.array([held_s(holds[i], horizon_s) for i in idx])
        out[idx] = total * own / own.sum() if own.sum() > 0 else total / len(idx)
    return out


def sweep_all(trace: Trace, costs: RungCosts, runtimes: int, names: Sequence[str], *,
              ladder: LadderPolicy | None = None, progress: Callable[[str], None] | None = None
              ) -> dict[str, list[AppFigures]]:
    """Every point of every named policy (`variants`), as per-application figures."""
    items = [app_items(a, trace.horizon_s) for a in trace.apps]
    share = max(1.0, len(trace.apps) / max(1, runtimes))
    out: dict[str, list[AppFigures]] = {}
    for name in names:
        began = time.perf_counter()
        out[name] = [figures(trace, run_point(trace, p, costs, runtimes, items), items, costs, runtimes, name, label)
                     for label, p in variants(name, costs, share, ladder)]
        if progress is not None:
            progress(f"{name}: {len(out[name])} points, {time.perf_counter() - began:.1f} s")
    return out


# The ladder's sweep each pair judges: its ATC objective (cold_value) on the ATC pair, start latency on the others.
JUDGED_BY = {"atc": "ladder-cold", "latency": "ladder", "p99": "ladder"}


def judge(points: Mapping[str, Sequence[AppFigures]], costs: RungCosts, *, resamples: int = 200, seed: int = 0,
          judged_by: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Per end rule and pair: the ladder (the sweep of its objective for that pair, `JUDGED_BY`, else any ladder
    sweep there is) against the pooled baselines and against each baseline alone."""
    start_s = costs.start_s()
    by = {**JUDGED_BY, **(judged_by or {})}
    bases = {name: list(pts) for name, pts in points.items() if name not in LADDERS}
    out: dict[str, Any] = {}
    for rule in END_RULES:
        against = {"pooled": Stack([p for pts in bases.values() for p in pts], start_s, rule),
                   **{name: Stack(pts, start_s, rule) for name, pts in bases.items()}}
        out[rule] = {}
        for pair in ENVELOPE_PAIRS:
            name = by[pair] if by[pair] in points else next(n for n in LADDERS if n in points)
            ladder = Stack(points[name], start_s, rule)
            out[rule][pair] = {base: {**judge_pair(ladder, stack, pair, resamples=resamples, seed=seed),
                                      "ladder": name} for base, stack in against.items()}
    return out


def summary(points: Mapping[str, Sequence[AppFigures]], costs: RungCosts) -> dict[str, list[dict[str, Any]]]:
    """Each point's whole-trace figures, per end rule: idle GB*h, p75 cold share, mean and p99 start latency."""
    start_s = costs.start_s()
    out: dict[str, list[dict[str, Any]]] = {}
    for name, pts in points.items():
        rows = []
        for p in pts:
            w = np.ones(len(p.cold))
            st = Stack([p], start_s, END_RULES[0])
            rows.append({"label": p.label,
                         **{f"idle_gb_h_{rule}": float(p.mem[rule].sum()) / 3600 / 1024 for rule in END_RULES},
                         "app_cold_p75": float(st.quality("atc", w)[0]),
                         "latency_mean_ms": 1e3 * float(st.quality("latency", w)[0]),
                         "latency_p99_ms": 1e3 * float(st.quality("p99", w)[0])})
        out[name] = rows
    return out


def table(verdict: Mapping[str, Any]) -> str:
    """The verdict as text: one line per end rule, pair and comparison."""
    lines = [f"{'end rule':9} {'pair':8} {'against':14} {'max_eps':>9} {'worst at':>34} {'>1%':>7} "
             f"{'geo_saving':>10} {'95% CI':>17}"]

    def pct(x: float | None) -> str:
        return "—" if x is None else ("inf" if not np.isfinite(x) else f"{100 * x:+.1f}%")

    for rule, pairs in verdict.items():
        for pair, rows in pairs.items():
            for name, r in rows.items():
                ci = "—" if r["ci_low"] is None else f"[{pct(r['ci_low'])}, {pct(r['ci_high'])}]"
                worst = pct(r["max_eps"]) if r["ladder_reaches"] else "inf"
                lines.append(f"{rule:9} {pair:8} {name:14} {worst:>9} {r['worst_point'] or '—'!s:>34} "
                             f"{r['over_1pct']:>3}/{r['judged']:<3} {pct(r['geo_saving']):>10} {ci:>17}")
    return "\n".join(lines)


__all__ = ["BASELINES", "LADDERS", "figures", "judge", "summary", "sweep_all", "table", "variants"]
