"""Throughput of the keep-alive simulator and solve time of the buffer planner, measured in one run.

Rows:
- a synthetic Azure-2019 day (per-minute counts; a minute's arrivals are one group, so the
  engine evaluates one item per busy minute rather than one per invocation);
- explicit per-invocation Poisson arrivals (one item per invocation, no grouping), which is
  the engine's floor;
each for the fixed, hybrid, ladder and rainbowcake policies at their defaults (per application) and
faascache at its default budget (the shared-node engine: one event-driven pass over every group),
giving simulated invocations per second of wall time (target: >= 1,000,000 for the ladder on the
per-invocation row) and items per second.
- the LP buffer planner on 1,000 models x 6 slice profiles (target: under a second).

Prints a table and writes JSON to bench/results/sim_throughput.json.
Usage: python bench/sim_throughput.py [--apps 1000] [--poisson-apps 1000] [--poisson-rate 0.02]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from ember.clock import SystemClock
from ember.core.planner import ModelDemand, SliceProfile, plan_buffer
from ember.core.rung_costs import RungCosts
from ember.keepalive.policies import FixedKeepAlive, HybridHistogram, LadderPolicy
from ember.sim.engine import app_items, poisson_trace
from ember.sim.greedy_dual import FaaSCache
from ember.sim.keepalive_layered import RainbowCake
from ember.sim.runner import SimPolicy, run_one
from ember.sim.synthetic import SyntheticConfig, synthetic_trace
from ember.sim.traces import Trace

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_PER_S = 1_000_000


def policies(apps: int, runtimes: int) -> list[tuple[str, SimPolicy]]:
    share = max(1.0, apps / runtimes)
    # "ladder-heldout": the ladder as the held-out evaluation runs it (`ember.sim.heldout.GRID`'s fixed constants:
    # the pooled prior, one pseudo-arrival per cell and the head at 12 splits; and the zygote's rent and the climbs'
    # lead times, which both tunings chose), those that add cells or passes over them.
    held = LadderPolicy(zygote_share=share, pooled_weight=1.0, smooth_events=1.0, head_splits=12, rent_floor=1.0,
                        climb_lead=1.0)
    return [("fixed", FixedKeepAlive()), ("hybrid", HybridHistogram()), ("ladder", LadderPolicy(zygote_share=share)),
            ("ladder-heldout", held), ("rainbowcake", RainbowCake(zygote_share=share)), ("faascache", FaaSCache())]


def sim_rows(label: str, trace: Trace, runtimes: int) -> list[dict[str, Any]]:
    began = time.perf_counter()
    items = [app_items(a, trace.horizon_s) for a in trace.apps]
    prep_s = time.perf_counter() - began
    n_items = int(sum(len(i.gaps) for i in items))
    rows = []
    for name, policy in policies(len(trace.apps), runtimes):
        began = time.perf_counter()
        run_one(trace, policy, RungCosts(), runtimes=runtimes, items=items)
        # Charge the trace preparation to every per-application run (the shared engine does its own).
        wall = time.perf_counter() - began + (0.0 if isinstance(policy, FaaSCache) else prep_s)
        rows.append({"trace": label, "policy": name, "apps": len(trace.apps),
                     "invocations": trace.invocations, "items": n_items, "wall_s": wall,
                     "invocations_per_s": trace.invocations / wall, "items_per_s": n_items / wall,
                     "vs_target": trace.invocations / wall / TARGET_PER_S})
    return rows


def planner_row(models: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    per = {"mig-1g": 1, "mig-2g": 2, "mig-3g": 3, "mig-4g": 4, "mig-7g": 7, "cpu": 0.5}
    costs = (1.0, 1.9, 2.8, 3.6, 6.0, 0.3)
    profiles = [SliceProfile(n, models // 3, c) for n, c in zip(per, costs, strict=True)]
    demands = [ModelDemand(f"m{i}", float(10 ** rng.uniform(-2, 1.3)), per, float(rng.uniform(0.5, 5)))
               for i in range(models)]
    began = time.perf_counter()
    plan = plan_buffer(demands, profiles, SystemClock())
    total = time.perf_counter() - began
    return {"models": models, "profiles": len(profiles), "variables": plan.variables, "build_s": plan.build_s,
            "solve_s": plan.solve_s, "total_s": total, "status": plan.status,
            "expected_cold_starts": plan.expected_cold_starts, "idle_cost": plan.idle_cost}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--apps", type=int, default=1000)
    ap.add_argument("--poisson-apps", type=int, default=1000)
    ap.add_argument("--poisson-rate", type=float, default=0.02, help="arrivals per second per app (a day)")
    ap.add_argument("--runtimes", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    began = time.perf_counter()
    synthetic = synthetic_trace(SyntheticConfig(apps=args.apps, seed=args.seed))
    gen_s = time.perf_counter() - began
    rows = sim_rows(f"synthetic azure2019 day, {args.apps} apps", synthetic, args.runtimes)
    poisson = poisson_trace(args.poisson_rate, 86400.0, seed=args.seed, apps=args.poisson_apps)
    rows += sim_rows(f"per-invocation poisson day, {args.poisson_apps} apps", poisson, args.runtimes)
    plan = planner_row(1000, args.seed)

    print(f"synthetic day generated in {gen_s:.2f} s")
    head = f"{'trace':<42} {'policy':<14} {'invocations':>13} {'items':>11} {'wall s':>7} {'inv/s':>13} {'x 1M/s':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['trace']:<42} {r['policy']:<14} {r['invocations']:>13,} {r['items']:>11,} {r['wall_s']:>7.2f} "
              f"{r['invocations_per_s']:>13,.0f} {r['vs_target']:>7.1f}")
    # The machine is shared and noisy: the ladder's figure against the fixed policy's of the same run travels better.
    ratios = {r["trace"]: r["invocations_per_s"] for r in rows if r["policy"] == "ladder"}
    for r in rows:
        if r["policy"] == "fixed":
            ratios[r["trace"]] /= r["invocations_per_s"]
            print(f"ladder / fixed on {r['trace']}: {ratios[r['trace']]:.2f}")
    print(f"\nLP buffer planner, {plan['models']} models x {plan['profiles']} profiles: "
          f"{plan['variables']:,} variables, build {plan['build_s']:.3f} s + solve {plan['solve_s']:.3f} s "
          f"= {plan['total_s']:.3f} s ({plan['status']})")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "sim_throughput.json"
    out.write_text(json.dumps({"generate_s": gen_s, "simulator": rows, "ladder_vs_fixed": ratios, "planner": plan,
                               "target_invocations_per_s": TARGET_PER_S}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
