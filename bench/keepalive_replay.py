"""Keep-alive plans, live against simulated: a window of a real trace replayed against `ember serve --keepalive X`.

See `ember.testing.replay` for what is measured and how. Prints a table per policy and writes JSON.

Usage: python bench/keepalive_replay.py [--trace DIR] [--app NAME] [--start S] [--length S] [--scale F]
       [--policy fixed-zygote=2 ...] [--out bench/results/keepalive_replay.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ember.core.idle_plan import LEVELS
from ember.testing.replay import STATES, TRACES, run


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=TRACES / "azure-llm-2023")
    p.add_argument("--app", default="code")
    p.add_argument("--start", type=float, default=1500.0, help="window start, seconds into the trace")
    p.add_argument("--length", type=float, default=300.0, help="window length, trace seconds")
    p.add_argument("--scale", type=float, default=1.0, help="replay this many times faster than the trace")
    p.add_argument("--policy", action="append", help="policy[=knob], repeatable (default: a few)")
    p.add_argument("--margin-s", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=Path("bench/results/keepalive_replay.json"))
    args = p.parse_args()
    specs = args.policy or ["fixed=2", "fixed-zygote=2", "ladder=3000"]
    results = []
    for spec in specs:
        name, _, knob = spec.partition("=")
        results.append(run(args.trace, args.app, args.start, args.length, args.scale, name,
                           float(knob) if knob else None, args.margin_s))
        print(table(results[-1:]), flush=True)
    print()
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
