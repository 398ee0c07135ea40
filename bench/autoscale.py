"""Ray's autoscaler, for real (issue 32, "Autoscaler from zero"): the first answer of a queued request after the
job was accepted, and the time back to zero workers after Ray's idle timeout.

One Ray head in PID, mount and network namespaces of its own, Ray's `StandardAutoscaler` (v1) with its fake
multi-node provider (one worker type: 1 CPU, 0 to 1 workers, idle timeout 6 s, the monitor's loop 1 s), ember's
controller and a gateway only on the head, one PostgreSQL job store: `ember.testing.autoscale`. Each round starts
from zero workers: a request for `sleeper` (0 s) through the head becomes a 202 job; the controller asks Ray for
a machine; Ray's autoscaler starts a raylet; the launcher starts `ember serve` for it (a KubeRay pod's command),
which deploys sleeper and runs the job; then a request of 8 s (longer than the idle timeout) through the head,
which the worker serves holding its Ray bundle; then idle, the bundle is released and Ray removes the worker.

    python bench/autoscale.py [--rounds 3] [--v2]   (under `flock /tmp/bench.lock` on a shared machine)

`--v2`: Ray's autoscaler v2 (`RAY_enable_autoscaler_v2=1`, the same provider named as an external one), written
to bench/results/autoscale-v2.json. `--control`: the same rounds, but the worker's bundle is taken away from
outside while it serves the 8 s request (its node then holds nothing, as every node did before the hold): what
Ray's autoscaler does to a busy worker that looks idle; written to bench/results/autoscale-control.json.

Targets: the first answer <= 30 s after the job was accepted (the 202 came back) until its status is
`succeeded`; back to zero workers after the idle timeout: every round reaches zero workers, no sooner than the
idle timeout after the worker released its bundle (the start of Ray's idle clock) and within the idle timeout
+ 3 s (the monitor's 1 s loop, the raylet's report, the kill). Prints a table, writes bench/results/autoscale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SLEEPER = ROOT / "tests" / "fixtures" / "models" / "sleeper.yaml"
FIRST_ANSWER_TARGET_S = 30.0
IDLE_TIMEOUT_S, BUSY_S, SLACK_S = 6.0, 8.0, 3.0
COLUMNS = ("asked", "raylet", "held", "joined", "answered", "withdrawn", "busy_done", "released", "zero")


def judge(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    answers = [r["events"]["answered"] for r in rounds]
    back = [r["events"]["zero"] - r["events"]["released"] for r in rounds]
    return {
        "first_answer_s": answers, "first_answer_max_s": max(answers),
        "first_answer_met": all(a <= FIRST_ANSWER_TARGET_S for a in answers),
        "released_to_zero_s": [round(b, 3) for b in back],
        "back_to_zero_met": all(IDLE_TIMEOUT_S <= b <= IDLE_TIMEOUT_S + SLACK_S for b in back),
        "kept_while_busy": all(r["survived_busy"] for r in rounds),
        "one_worker_per_round": all(r["workers_launched"] == 1 for r in rounds),
    }


def table(rounds: list[dict[str, Any]]) -> str:
    columns = (*COLUMNS, "hold_dropped", "raylet_gone") if any(r["control"] for r in rounds) else COLUMNS
    head = "| round | " + " | ".join(columns) + " | released to zero | busy request |"
    lines = [head, "|" + "---|" * (len(columns) + 3)]
    for i, r in enumerate(rounds, 1):
        e = r["events"]
        cells = [f"{e[c]:.1f}" if c in e else "-" for c in columns]
        kept = "kept" if r["survived_busy"] else "worker removed"
        lines.append(f"| {i} | " + " | ".join(cells) + f" | {e['zero'] - e['released']:.1f} | "
                     f"{r['busy_status']}, {kept} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--v2", action="store_true", help="Ray's autoscaler v2 instead of v1")
    p.add_argument("--control", action="store_true", help="take the worker's bundle away while it is busy")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ember-autoscale-") as tmp:
        out = Path(tmp) / "result.json"
        began = time.monotonic()
        subprocess.run([sys.executable, "-m", "ember.testing.autoscale", "--model", str(SLEEPER), "--root",
                        str(Path(tmp) / "cluster"), "--out", str(out), "--rounds", str(args.rounds),
                        "--idle-timeout-s", str(IDLE_TIMEOUT_S), "--busy-s", str(BUSY_S), "--timeout-s", "120",
                        *(["--v2"] if args.v2 else []), *(["--control"] if args.control else [])],
                       check=False, timeout=120 + args.rounds * 180)
        wall_s = time.monotonic() - began
        result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"error": "no result written"}
    if "error" in result:
        print(f"failed: {result['error']}", file=sys.stderr)
        return 1
    verdict = judge(result["rounds"])
    print(f"Ray's autoscaler {result['settings']['autoscaler']}; cluster up in {result['cluster_start_s']:.1f} s; "
          "seconds after each round's 202 "
          f"(idle timeout {IDLE_TIMEOUT_S:g} s, busy request {BUSY_S:g} s, linger 2 s):")
    print(table(result["rounds"]))
    print(f"first answer <= {FIRST_ANSWER_TARGET_S:g} s: {'met' if verdict['first_answer_met'] else 'NOT met'} "
          f"(max {verdict['first_answer_max_s']:.1f} s); back to zero after the idle timeout "
          f"({IDLE_TIMEOUT_S:g} to {IDLE_TIMEOUT_S + SLACK_S:g} s after the release): "
          f"{'met' if verdict['back_to_zero_met'] else 'NOT met'} {verdict['released_to_zero_s']}; "
          f"worker kept while busy: {verdict['kept_while_busy']}")
    record = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_1m": os.getloadavg()[0],
              "wall_s": round(wall_s, 1), "targets": {"first_answer_s": FIRST_ANSWER_TARGET_S,
                                                     "back_to_zero_s": [IDLE_TIMEOUT_S, IDLE_TIMEOUT_S + SLACK_S]},
              "verdict": verdict, **result}
    name = "autoscale" + ("-v2" if args.v2 else "") + ("-control" if args.control else "")
    path = ROOT / "bench" / "results" / f"{name}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
