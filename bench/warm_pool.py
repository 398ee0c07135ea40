"""The LP warm pool (lp-buffer) against FaaSCache's greedy-dual and the live LRU order, at the same node budgets.

All three run on the shared-node engine (`ember.sim.shared_engine`): one node whose idle instances share a
memory budget, every policy dropping an evicted instance to its runtime's zygote (parity). lp-buffer plans
every simulated minute (`LpBuffer.period_s`), at `latency_value` 1e5 (the ladder's default: an idle minute of
an instance pays if an arrival in it is more likely than 0.5) and 1e7 (more than 0.005: the budget decides).

Traces: the synthetic day (1,000 apps, seed 0) and, when present, the Azure LLM 2023 trace and the Azure
Functions 2021 sample from ../shared/traces (or --traces DIR). Budgets per trace (--budgets-* in GB): the
synthetic day's below 64 GB are mostly over budget (its busy instances alone overflow them), so the
comparison starts at 32 GB to show it.

Prints one table per trace (a row per budget and policy) and writes bench/results/warm_pool.json.
Usage: python bench/warm_pool.py [--apps 1000] [--traces ../shared/traces]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from ember.core.rung_costs import RungCosts
from ember.sim.greedy_dual import FaaSCache, LpBuffer, LruEvict
from ember.sim.report import run_dict
from ember.sim.shared_engine import simulate_shared
from ember.sim.synthetic import SyntheticConfig, synthetic_trace
from ember.sim.traces import Trace, read_trace

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


def rows(trace: Trace, budgets: list[float], runtimes: int, latency_values: list[float]) -> list[dict[str, Any]]:
    costs = RungCosts()
    out = []
    for gb in budgets:
        policies = [FaaSCache(gb), LruEvict(gb), *(LpBuffer(gb, latency_value=v) for v in latency_values)]
        for policy in policies:
            began = time.perf_counter()
            r = simulate_shared(trace, policy, costs, runtimes=runtimes)
            label = f"lp@{policy.latency_value:.0e}" if isinstance(policy, LpBuffer) else policy.name
            out.append({"trace": trace.name, "budget_gb": gb, "policy": label,
                        "latency_value": getattr(policy, "latency_value", None),
                        "wall_s": time.perf_counter() - began, **run_dict(r, costs)})
    return out


def print_table(trace: Trace, table: list[dict[str, Any]]) -> None:
    print(f"\n{trace.name}: {len(trace.apps)} apps, {trace.invocations:,} invocations, {trace.horizon_s / 3600:.2f} h")
    head = (f"{'GB':>6} {'policy':<10} {'hot':>11} {'zygote':>8} {'fetch':>6} {'cold %':>7} {'mean ms':>8} "
            f"{'p99 ms':>8} {'idle GB*h':>10} {'over budget':>11} {'prewarms':>8} {'LP solves':>9} {'wall s':>7}")
    print(head)
    print("-" * len(head))
    for r in table:
        s = r["starts_by_rung"]
        lp = r["latency_value"] is not None
        solves = f"{r['lp_solves']}/{r['plans']}" if lp else ""
        print(f"{r['budget_gb']:>6g} {r['policy']:<10} {s['hot']:>11,} {s['zygote']:>8,} {s['fetch']:>6,} "
              f"{100 * r['cold_start_rate']:>7.3f} {1e3 * r['latency_mean_s']:>8.3f} {1e3 * r['latency_p99_s']:>8.2f} "
              f"{r['idle_gb_h']:>10.2f} {r['over_budget_starts']:>11,} {r['prewarms'] if lp else '':>8} "
              f"{solves:>9} {r['wall_s']:>7.2f}")


def traces(args: argparse.Namespace) -> list[tuple[Trace, list[float]]]:
    out = [(synthetic_trace(SyntheticConfig(apps=args.apps, seed=args.seed)), args.budgets_synthetic)]
    base = Path(args.traces)
    for sub, fmt, budgets in (("azure-llm-2023", "azurellm", args.budgets_llm),
                              ("azure-functions-2021-sample", "azure2021", args.budgets_2021)):
        if (base / sub).exists():
            out.append((read_trace(base / sub, fmt, seed=args.seed), budgets))
        else:
            print(f"skipped {base / sub}: not found")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--apps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runtimes", type=int, default=2)
    ap.add_argument("--latency-values", type=float, nargs="+", default=[1e5, 1e7],
                    help="lp-buffer's latency_value (MB*s per second of start latency), one row each")
    ap.add_argument("--traces", default=str(REPO.parent / "shared" / "traces"))
    ap.add_argument("--budgets-synthetic", type=float, nargs="+", default=[32.0, 64.0, 128.0, 256.0])
    ap.add_argument("--budgets-llm", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--budgets-2021", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0, 4.0])
    args = ap.parse_args()
    results = []
    for trace, budgets in traces(args):
        table = rows(trace, budgets, args.runtimes, args.latency_values)
        print_table(trace, table)
        results += table
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "warm_pool.json"
    out.write_text(json.dumps({"latency_values": args.latency_values, "runtimes": args.runtimes, "rows": results},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
