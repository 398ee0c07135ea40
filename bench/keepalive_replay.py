"""Keep-alive plans, live against simulated: a window of a real trace replayed against `ember serve --keepalive X`.

See `ember.testing.replay` for what is measured and how. Prints a table per policy and writes JSON.
With `--apps A,B,...` several applications are replayed together, one model each, sharing one zygote
(`ember.testing.replay_many`): a table per policy with a row per model and side, the zygote and the totals.

Usage: python bench/keepalive_replay.py [--trace DIR] [--app NAME | --apps A,B,...] [--start S] [--length S]
       [--scale F] [--policy fixed-zygote=2 ...] [--out bench/results/keepalive_replay[_many].json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ember.keepalive.idle_plan import LEVELS
from ember.testing.replay import STATES, TRACES, run
from ember.testing.replay_many import MODEL_STATES, run_many


def table(results: list[dict[str, Any]]) -> str:
    lines = [f"{'policy':<14}{'knob':>6}  {'side':<5}" + "".join(f"{lv.value:>9}" for lv in LEVELS)
             + f"{'idle MB*s':>11}{'inst s':>8}{'tmpl s':>8}{'zyg s':>8}{'none s':>8}"]
    for r in results:
        for side in ("live", "sim", "plan"):
            mb = r[side]["idle_pss_mb_s" if side == "live" else "idle_mb_s"]
            d = r[side]
            lines.append(f"{r['policy']:<14}{r['knob']:>6g}  {side:<5}"
                         + "".join(f"{d['starts'][lv.value]:>9}" for lv in LEVELS)
                         + f"{mb:>11.0f}" + "".join(f"{d['state_s'][s]:>8.1f}" for s in STATES))
        det = r["determined"]
        live = r["live"]["idle_pss_mb_s"]
        err, err_plan = (live / max(1e-9, r[side]["idle_mb_s"]) - 1 for side in ("sim", "plan"))
        lines.append(f"{'':<22}determined arrivals on the predicted rung: {det['agree']}/{det['n']}; "
                     f"idle memory live vs sim {100 * err:+.1f}%, vs plan {100 * err_plan:+.1f}%")
    return "\n".join(lines)


def _pct(live: float, sim: float) -> str:
    return f"{100 * (live / sim - 1):+.1f}%" if sim > 0 else "n/a"


def table_many(results: list[dict[str, Any]]) -> str:
    """Per policy: each model's starts per rung, seconds per state and idle MB*s, live and simulated ("sim"; for a
    ladder pricing the zygote at its marginal cost, "even": the same with the zygote split evenly throughout);
    the zygote's seconds up and MB*s; the totals."""
    head = (f"{'policy':<14}{'knob':>6}  {'model':<8}{'side':<5}" + "".join(f"{lv.value:>9}" for lv in LEVELS)
            + "".join(f"{s + ' s':>11}" for s in MODEL_STATES) + f"{'idle MB*s':>11}")
    lines = [head]
    for r in results:
        lead = f"{r['policy']:<14}{r['knob']:>6g}  "
        for m, v in r["models"].items():
            sides = [("live", v["live"], v["live"]["starts"]), ("sim", v["sim"], v["sim"]["starts"])] + (
                [("even", v["even"], v["even"]["starts"])] if "even" in v else [])
            for side, d, starts in sides:
                lines.append(lead + f"{m:<8}{side:<5}" + "".join(f"{starts[lv.value]:>9}" for lv in LEVELS)
                             + "".join(f"{d['state_s'][s]:>11.1f}" for s in MODEL_STATES) + f"{d['idle_mb_s']:>11.0f}")
        z = r["zygote"]
        for side in [k for k in ("live", "sim", "even") if k in z]:
            lines.append(lead + f"{'zygote':<8}{side:<5}{'':>45}{'up ' + format(z[side]['up_s'], '.1f') + ' s':>33}"
                         f"{z[side]['mb_s']:>11.0f}")
        det = "; ".join(f"{m} {v['live']['determined']['agree']}/{v['live']['determined']['n']}"
                        for m, v in r["models"].items())
        lines.append(f"{'':<22}total idle MB*s live {r['total']['live']:.0f}, sim {r['total']['sim']:.0f} "
                     f"({_pct(r['total']['live'], r['total']['sim'])}); zygote up live vs sim "
                     f"{_pct(z['live']['up_s'], z['sim']['up_s'])} (from {r['since_s']:.1f} s); "
                     f"determined arrivals on the predicted rung: {det}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=TRACES / "azure-llm-2023")
    p.add_argument("--app", default="code")
    p.add_argument("--apps", help="several applications, comma-separated, replayed together sharing one zygote")
    p.add_argument("--start", type=float, default=1500.0, help="window start, seconds into the trace")
    p.add_argument("--length", type=float, default=300.0, help="window length, trace seconds")
    p.add_argument("--scale", type=float, default=1.0, help="replay this many times faster than the trace")
    p.add_argument("--policy", action="append", help="policy[=knob], repeatable (default: a few)")
    p.add_argument("--margin-s", type=float, default=0.5)
    p.add_argument("--out", type=Path, help="JSON (default bench/results/keepalive_replay[_many].json)")
    args = p.parse_args()
    specs = args.policy or ["fixed=2", "fixed-zygote=2", "ladder=3000"]
    apps = [a.strip() for a in args.apps.split(",") if a.strip()] if args.apps else None
    show = table if apps is None else table_many
    args.out = args.out or Path(f"bench/results/keepalive_replay{'' if apps is None else '_many'}.json")
    results = []
    for spec in specs:
        name, _, knob = spec.partition("=")
        value = float(knob) if knob else None
        results.append(run(args.trace, args.app, args.start, args.length, args.scale, name, value, args.margin_s)
                       if apps is None else
                       run_many(args.trace, apps, args.start, args.length, args.scale, name, value, args.margin_s))
        print(show(results[-1:]), flush=True)
    print()
    print(show(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
