"""Reports of a simulation: a table for the terminal, JSON, and a PNG of the policies' frontiers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ember.core.rung_costs import RungCosts
from ember.errors import InvalidInput
from ember.keepalive.idle_plan import LEVELS
from ember.sim.engine import RunResult
from ember.sim.runner import PolicySweep, compare
from ember.sim.traces import Trace

_GB_H = 1024.0 * 3600.0   # MB*s in a GB*h


def run_dict(r: RunResult, costs: RungCosts) -> dict[str, Any]:
    return {
        "knob": r.knob,
        "knob_value": r.knob_value,
        "invocations": r.invocations,
        "starts_by_rung": {str(lv): int(n) for lv, n in zip(LEVELS, r.starts, strict=True)},
        "cold_start_rate": r.cold_start_rate,
        "fetch_rate": float(r.starts[-1] / max(1, r.invocations)),
        "app_cold_start_p75": r.app_cold_p75,
        "latency_mean_s": r.latency_mean(costs),
        "latency_p50_s": r.latency_quantile(costs, 0.5),
        "latency_p99_s": r.latency_quantile(costs, 0.99),
        "idle_mb_s": r.total_idle_mb_s,
        "idle_gb_h": r.total_idle_mb_s / _GB_H,
        "idle_mb_s_by_rung": {str(lv): float(v) for lv, v in zip(LEVELS, r.idle_mb_s, strict=True)},
        "shared_zygote_mb_s": r.shared_mb_s,
        "over_budget_starts": r.over_budget,
        "prewarms": r.prewarms,
        "plans": r.plans,
        "lp_solves": r.lp_solves,
        "wall_s": r.wall_s,
    }


def build_report(trace: Trace, sweeps: list[PolicySweep], costs: RungCosts, **settings: Any) -> dict[str, Any]:
    report: dict[str, Any] = {
        "trace": {"name": trace.name, "format": trace.format, "apps": len(trace.apps),
                  "invocations": trace.invocations, "horizon_s": trace.horizon_s},
        "settings": settings,
        "rung_costs": {str(lv): {"idle_mb": c.idle_mb, "start_s": c.start_s}
                       for lv, c in zip(LEVELS, costs.by_level(), strict=True)},
        "policies": {},
    }
    for s in sweeps:
        report["policies"][s.name] = {
            "knob": s.knob,
            "default": run_dict(s.default, costs),
            "sweep": [run_dict(r, costs) for r in s.points()],
            "frontier_cold_start_rate": [run_dict(r, costs) for r in s.frontier("cold_start_rate")],
            "frontier_latency_mean": [run_dict(r, costs) for r in s.frontier("latency_mean", costs)],
        }
    by_name = {s.name: s for s in sweeps}
    if "ladder" in by_name:
        report["ladder_vs"] = {n: compare(by_name["ladder"], s, costs) for n, s in by_name.items() if n != "ladder"}
    return report


def table(report: dict[str, Any]) -> str:
    t = report["trace"]
    lines = [f"trace {t['name']} ({t['format']}): {t['apps']} apps, {t['invocations']:,} invocations, "
             f"{t['horizon_s'] / 3600:.2f} h"]
    head = (f"{'policy':<13} {'knob':>22} {'hot':>11} {'paused':>8} {'template':>9} {'zygote':>9} {'fetch':>8} "
            f"{'cold %':>7} {'app p75 %':>9} {'p50 ms':>8} {'p99 ms':>9} {'mean ms':>9} {'idle GB*h':>10}")
    lines += [head, "-" * len(head)]
    for name, p in report["policies"].items():
        others = sorted((r for r in p["sweep"] if r["knob_value"] != p["default"]["knob_value"]),
                        key=lambda r: r["knob_value"])
        rows = [("*", p["default"]), *((" ", r) for r in others)]
        for mark, r in rows:
            s = r["starts_by_rung"]
            knob = f"{r['knob']}={r['knob_value']:.4g}"
            lines.append(
                f"{name + mark:<13} {knob:>22} {s['hot']:>11,} {s['paused']:>8,} {s['template']:>9,} "
                f"{s['zygote']:>9,} {s['fetch']:>8,} {100 * r['cold_start_rate']:>7.3f} "
                f"{100 * r['app_cold_start_p75']:>9.2f} {1e3 * r['latency_p50_s']:>8.2f} "
                f"{1e3 * r['latency_p99_s']:>9.2f} {1e3 * r['latency_mean_s']:>9.3f} {r['idle_gb_h']:>10.2f}")
    lines.append("* = the policy's default knob; cold = a start that needed a new process (template, zygote, fetch)")
    for other, rows in report.get("ladder_vs", {}).items():
        same_mem = sum(bool(r["ladder_wins_same_memory"]) for r in rows)
        same_lat = sum(bool(r["ladder_wins_same_latency"]) for r in rows)
        lines.append(f"ladder vs {other}: lower mean (and no higher p99) latency at no more idle memory at "
                     f"{same_mem}/{len(rows)} of its points; less idle memory at no more mean latency at "
                     f"{same_lat}/{len(rows)}")
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
    except OSError as err:
        raise InvalidInput(f"--out {path.parent}: cannot write: {err.strerror or err}") from None


def plot(report: dict[str, Any], path: Path) -> None:
    """Two panels over idle memory: the cold-start rate and the mean start latency, one curve per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for name, p in report["policies"].items():
        pts = p["sweep"]
        x = [max(r["idle_gb_h"], 1e-6) for r in pts]
        axes[0].plot(x, [max(r["cold_start_rate"], 1e-7) for r in pts], "o-", label=name)
        axes[1].plot(x, [1e3 * max(r["latency_mean_s"], 1e-7) for r in pts], "o-", label=name)
        d = p["default"]
        axes[0].plot([max(d["idle_gb_h"], 1e-6)], [max(d["cold_start_rate"], 1e-7)], "k*", ms=10)
        axes[1].plot([max(d["idle_gb_h"], 1e-6)], [1e3 * max(d["latency_mean_s"], 1e-7)], "k*", ms=10)
    for ax, label in zip(axes, ("cold-start rate (new process)", "mean start latency (ms)"), strict=True):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("idle memory (GB*h)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"keep-alive policies on {report['trace']['name']} (knob sweeps; * = default)")
    save_figure(fig, path, dpi=110)


def save_figure(fig: Any, path: Path, dpi: int) -> None:
    """Write a matplotlib figure (and close it); a folder that cannot be written is an error naming `--out`."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    except OSError as err:
        raise InvalidInput(f"--out {path.parent}: cannot write: {err.strerror or err}") from None
    finally:
        plt.close(fig)
