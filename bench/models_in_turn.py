"""The three bundled models in turn: does a node keep them all hot, or does each request evict another's instance?

One run, per arm (a real `ember serve` with the bundled examples and default settings, as `make serve` runs it), in
blocks of `--block` rounds (so that the machine's noise falls on both phases alike):
- alone: each model's hot p50, `-n` requests per block back to back to it alone (after one more that brings its
  instance back, not counted);
- in turn: rounds of iris (V2 infer), minilm (/v1/embeddings), smollm2 (/v1/chat/completions, `--max-tokens` tokens,
  temperature 0), one request at a time, `--rounds` in all (each block's first round, after the alone phase, not
  counted); each model's p50 and p99, the rungs its requests came from (`Ember-Rung`) and the node's evictions
  (`ember_instance_events_total{event="evict"}`).
Arms: `shared` (this tree: the node's cores shared, its default), `dedicated` (this tree with every CPU slot
dedicated: `--dedicated-cpu-slots` = `--cpu-slots`, one instance per core as before) and, with `--base DIR`, the
same server from another checkout (e.g. `git worktree add /tmp/base 1ffd632`), run with PYTHONPATH=DIR.
Target: in turn, each model's p50 <= 1.3x its own hot p50 alone, and 0 evictions.
Prints a table and writes JSON to bench/results/models_in_turn.json.

Usage: python bench/models_in_turn.py [--rounds 200] [--block 20] [-n 5] [--max-tokens 8] [--base /tmp/base45]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from ember.testing.server import EmberServer

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("iris", "minilm", "smollm2")
TARGET_RATIO = 1.3


def request(model: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    """The route and body of one request to `model`."""
    if model == "iris":
        return "/v2/models/iris/infer", {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 4],
                                                     "data": [5.1, 3.5, 1.4, 0.2]}]}
    if model == "minilm":
        return "/v1/embeddings", {"model": "minilm", "input": ["ember keeps models warm"]}
    return "/v1/chat/completions", {"model": "smollm2", "max_tokens": max_tokens, "temperature": 0,
                                    "messages": [{"role": "user", "content": "Name a colour."}]}


def call(client: httpx.Client, model: str, max_tokens: int) -> tuple[float, str]:
    path, body = request(model, max_tokens)
    t0 = time.perf_counter()
    r = client.post(path, json=body)
    elapsed = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{model}: {r.status_code} {r.text[:300]}")
    return elapsed, r.headers.get("ember-rung", "?")


def evictions(client: httpx.Client) -> float:
    text = client.get("/metrics").text
    return sum(float(m.group(1)) for m in
               re.finditer(r'^ember_instance_events_total\{[^}]*event="evict"[^}]*\} (\S+)$', text, re.M))


def summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {"n": len(ordered), "p50_ms": statistics.median(ordered) * 1e3,
            "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3}


def run_arm(name: str, args: argparse.Namespace, serve_args: tuple[str, ...], tree: Path) -> dict[str, Any]:
    """One server, run from the checkout `tree` (its working directory and PYTHONPATH: `python -m` imports from
    there)."""
    env = {"PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory(prefix="in-turn-") as tmp, \
            EmberServer(Path(tmp), *serve_args, "--log-level", "warning", examples=True, env=env, cwd=tree) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        for model in MODELS:    # the first request of each starts its instance; a few more warm it up
            for _ in range(3):
                call(client, model, args.max_tokens)
        alone: dict[str, list[float]] = {m: [] for m in MODELS}
        turns: dict[str, list[float]] = {m: [] for m in MODELS}
        rungs: dict[str, Counter[str]] = {m: Counter() for m in MODELS}
        evicted, wall, done = 0.0, 0.0, 0
        while done < args.rounds:
            for model in MODELS:
                call(client, model, args.max_tokens)   # its instance back (another's request may have evicted it)
                alone[model] += [call(client, model, args.max_tokens)[0] for _ in range(args.n)]
            for model in MODELS:    # a round not counted: each instance back from the alone phase (paused, evicted)
                call(client, model, args.max_tokens)
            before, t0 = evictions(client), time.monotonic()
            for _ in range(min(args.block, args.rounds - done)):
                for model in MODELS:
                    elapsed, rung = call(client, model, args.max_tokens)
                    turns[model].append(elapsed)
                    rungs[model][rung] += 1
                done += 1
            wall += time.monotonic() - t0
            evicted += evictions(client) - before
        in_turn = {m: {**summary(turns[m]), "rungs": dict(rungs[m]),
                       "ratio": statistics.median(turns[m]) / statistics.median(alone[m])} for m in MODELS}
    return {"arm": name, "serve_args": list(serve_args), "alone": {m: summary(v) for m, v in alone.items()},
            "in_turn": in_turn,
            "evictions": evicted, "wall_s": wall,
            "met": evicted == 0 and all(v["ratio"] <= TARGET_RATIO for v in in_turn.values())}


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"the three bundled models in turn, {report['rounds']} rounds, one request at a time "
                    f"(load before: {report['load_before']})")
    for col in ("arm", "model", "alone p50 ms", "in turn p50 ms", "in turn p99 ms", "p50 / alone", "rungs",
                "evictions"):
        t.add_column(col, justify="left" if col in ("arm", "model", "rungs") else "right")
    for arm in report["arms"]:
        for i, model in enumerate(MODELS):
            a, b = arm["alone"][model], arm["in_turn"][model]
            rungs = " ".join(f"{k}:{v}" for k, v in sorted(b["rungs"].items()))
            t.add_row(arm["arm"] if i == 0 else "", model, f"{a['p50_ms']:.1f}", f"{b['p50_ms']:.1f}",
                      f"{b['p99_ms']:.1f}", f"{b['ratio']:.2f}x", rungs, f"{arm['evictions']:g}" if i == 0 else "")
    Console(width=150).print(t)
    for arm in report["arms"]:
        print(f"{arm['arm']}: target (each p50 <= {TARGET_RATIO}x alone, 0 evictions) "
              f"{'met' if arm['met'] else 'NOT met'}; in-turn phase {arm['wall_s']:.1f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--block", type=int, default=20, help="in-turn rounds between two alone phases")
    p.add_argument("-n", type=int, default=5, help="requests per model alone in each block (its hot p50)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens each smollm2 request generates")
    p.add_argument("--base", type=Path, help="another checkout of ember to run the same server from (PYTHONPATH)")
    p.add_argument("--arms", default="shared,dedicated", help="of: shared, dedicated (this tree's)")
    p.add_argument("--out", type=Path, default=RESULTS / "models_in_turn.json")
    args = p.parse_args()
    slots = str(len(os.sched_getaffinity(0)))
    arms = {"shared": ("--cpu-slots", slots), "dedicated": ("--cpu-slots", slots, "--dedicated-cpu-slots", slots)}
    load = Path("/proc/loadavg").read_text().split()[:3]
    here = Path(__file__).resolve().parents[1]
    results = [run_arm(a, args, arms[a], here) for a in args.arms.split(",") if a]
    if args.base is not None:
        commit = subprocess.run(["git", "-C", str(args.base), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        results.append(run_arm(f"base {commit}", args, ("--cpu-slots", slots), args.base.resolve()))
    report = {"rounds": args.rounds, "block": args.block, "n_alone_per_block": args.n, "max_tokens": args.max_tokens,
              "load_before": " ".join(load),
              "load_after": " ".join(Path("/proc/loadavg").read_text().split()[:3]), "cpus": slots,
              "git": subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "arms": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
