"""Reports of the held-out evaluation: a table and verdict lines for the terminal, JSON, one PNG per trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ember.sim import verdict
from ember.sim.heldout import JUDGED_BY, PAIR_KEYS
from ember.sim.report import save_figure

_GB = 1024.0   # MB in a GB


def _gbs(p: dict[str, Any]) -> float:
    return float(p["idle_mb_s"]) / _GB


def point_row(p: dict[str, Any]) -> str:
    return (f"{p['label']:<58} {100 * p['app_cold_start_p75']:>9.2f} {100 * p['cold_start_rate']:>8.3f} "
            f"{1e3 * p['latency_mean_s']:>10.3f} {1e3 * p['latency_p99_s']:>9.2f} {_gbs(p):>14,.1f}")


HEAD = (f"{'policy[knob, variant]':<58} {'app p75 %':>9} {'cold %':>8} {'mean ms':>10} {'p99 ms':>9} "
        f"{'idle GB*s':>14}")


def tuning_lines(tunings: dict[str, Any]) -> list[str]:
    objectives = {t.get("objective") for t in tunings.values()} - {None}
    lines = [f"tuning objective: {o}" for o in sorted(objectives)]
    for name, t in tunings.items():
        best = ", ".join(f"{k}={v:g}" for k, v in t["best"].items())
        lines.append(f"tuned on {name}: {best}; score {_score(t['best_score'])} "
                     f"(class defaults: {_score(t['default_score'])}; {len(t['combinations'])} combinations)")
    return lines


def _score(s: list[float] | None) -> str:
    if s is None:
        return "not in the grid"
    return (f"(dominated {int(s[0])} (cold sweep on atc + latency sweep on latency), wins {-s[1]:.0%} of budgets "
            f"vs hybrid-zygote, log-area {s[2]:.4f})")


def verdict_lines(trace: str, tuned_on: str, v: dict[str, Any]) -> list[str]:
    """The claims on one trace, exactly: counts, and every dominated ladder point with its dominator."""
    who = f"ladder tuned on {tuned_on}, on {trace}"
    lines = []
    for pair, pair_keys in PAIR_KEYS.items():
        hits = v["dominated"].get(pair, [])
        keys = "/".join(pair_keys)
        tag = "" if pair in verdict.PAIRS else " (diagnostic)"
        sweep = v.get("judged_by", JUDGED_BY).get(pair, "ladder")
        n = v.get("points_by_sweep", {}).get(sweep, v["points"])
        most = max((h["to_shed"] for h in hits), default=None)
        lines.append(f"{who}: {sweep} dominated on the {pair} pair{tag} ({keys}) at {len(hits)} of {n} points"
                     + ("" if most is None else
                        f" (the most idle memory one would have to shed to be lifted: {100 * most:.2f}%):"))
        lines += [f"    {h['ladder']} by {h['by']} (shed {100 * h['to_shed']:.2f}%)" for h in hits]
    for metric, m in v["matched"].items():
        lines.append(f"{who}: beats hybrid-zygote on {metric} at {m['wins']} of {m['budgets']} matched budgets "
                     f"(ties {m['ties']}, losses {m['losses']})")
    lines += own_objective_lines(who, v.get("own_objective", []))
    c = v["claims"]
    lines.append(f"{who}: claim 'dominated by no baseline at any swept point on either pair': "
                 f"{'MET' if c['undominated_on_both_pairs'] else 'NOT MET'}; claim 'beats hybrid-zygote at >= half "
                 f"of the matched budgets (mean latency)': {'MET' if c['beats_hybrid_zygote_at_half'] else 'NOT MET'}")
    return lines


def own_objective_lines(who: str, rows: list[dict[str, Any]]) -> list[str]:
    """The diagnostic `verdict.own_objective`: at how many latency values the ladder's own objective is the lowest
    of all points, and where another point's is lowest, by how much (the largest first)."""
    if not rows:
        return []
    behind = sorted((r for r in rows if r["excess"] > verdict.REL_TOL), key=lambda r: -r["excess"])
    any_lowest = sum(r.get("excess_any", 0.0) <= verdict.REL_TOL for r in rows)
    lines = [f"{who}: ladder's own objective (idle MB*s + latency_value x total start latency) lowest of the "
             f"baselines' points at {len(rows) - len(behind)} of {len(rows)} latency values, of all points (the "
             f"ladder's other points too) at {any_lowest} (diagnostic)" + (":" if behind else "")]
    lines += [f"    at {r['value']:.4g}: {r['by']} lower by {r['excess']:.2%}" for r in behind]
    return lines


def table(result: dict[str, Any]) -> str:
    lines = tuning_lines(result["tuning"])
    for label, entry in result["traces"].items():
        t = entry["trace"]
        lines += ["", f"held-out trace {label} ({t['format']}): {t['apps']} apps, {t['invocations']:,} invocations, "
                      f"{t['horizon_s'] / 3600:.2f} h", HEAD, "-" * len(HEAD)]
        for pts in entry["baselines"].values():
            lines += [point_row(p) for p in sorted(pts, key=lambda p: p["idle_mb_s"])]
        for tuned_on, pts in [*entry["ladders"].items(), *entry.get("cold_ladders", {}).items()]:
            lines += [point_row({**p, "label": f"{p['label']} tuned on {tuned_on}"})
                      for p in sorted(pts, key=lambda p: p["idle_mb_s"])]
        lines += baseline_lines(label, entry["baselines"])
        for tuned_on, v in entry["verdicts"].items():
            lines += verdict_lines(label, tuned_on, v)
    return "\n".join(lines)


def baseline_lines(trace: str, baselines: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each baseline held to the first target against the other baselines (`verdict.among`): whether any policy
    meets it on this trace."""
    counts = {pair: verdict.among(baselines, keys) for pair, keys in verdict.PAIRS.items()}
    met = [name for name in baselines if not any(counts[pair][name][0] for pair in counts)]
    lines = [f"on {trace}, each baseline against the others (diagnostic): points dominated, "
             + "; ".join(f"{name} " + ", ".join(f"{pair} {counts[pair][name][0]} of {counts[pair][name][1]}"
                                                for pair in counts) for name in baselines),
             f"on {trace}, baselines dominated by no other baseline at any point on either pair: "
             + (", ".join(met) if met else "none")]
    return lines


def _frontier(points: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """Pareto points by idle memory (ascending) and `metric`."""
    out: list[dict[str, Any]] = []
    for p in sorted(points, key=lambda p: (p["idle_mb_s"], p[metric])):
        if not out or p[metric] < out[-1][metric]:
            out.append(p)
    return out


PANELS = (("latency_mean_s", 1e3, "mean start latency (ms)", "idle memory (GB*s)"),
          ("latency_p99_s", 1e3, "p99 start latency (ms)", "idle memory (GB*s)"),
          ("app_cold_start_p75", 100.0, "75th pct. per-app cold-start %", "wasted memory time (GB*s)"))


def plot(label: str, entry: dict[str, Any], path: Path) -> None:
    """Three panels over idle memory, each policy's frontier a line (its other swept points faint)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = {**entry["baselines"], **{f"ladder (tuned on {k})": v for k, v in entry["ladders"].items()},
             **{f"ladder-cold (tuned on {k})": v for k, v in entry.get("cold_ladders", {}).items()}}
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    for ax, (metric, scale, ylabel, xlabel) in zip(axes, PANELS, strict=True):
        for i, (name, pts) in enumerate(lines.items()):
            colour = f"C{i % 10}"
            front = _frontier(pts, metric)
            ax.plot([max(_gbs(p), 1e-3) for p in pts], [scale * p[metric] for p in pts], ".", color=colour,
                    alpha=0.25)
            ax.plot([max(_gbs(p), 1e-3) for p in front], [scale * p[metric] for p in front], "o-", color=colour,
                    label=name, ms=3, drawstyle="steps-post")
        ax.set_xscale("log")
        if metric != "app_cold_start_p75":
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    t = entry["trace"]
    fig.suptitle(f"held-out {label}: {t['apps']} apps, {t['invocations']:,} invocations "
                 f"(frontiers; faint: other swept points)")
    save_figure(fig, path, dpi=100)
