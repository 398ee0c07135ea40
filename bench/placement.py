"""Placement decision time across a cluster: 100 nodes, 1,000 models, 10,000 instances (issue 14's pure-core row).

A synthetic cluster, seeded: every model has 10 instances spread over random nodes (hot ones as warm
instances, paused ones in the holdings), a template on a few nodes, its chunks wholly or partly on some;
nodes with random free memory, free slices, queues and bandwidths. Measured, one decision at a time
(time.perf_counter_ns around each call, models drawn at random):

- `place` on the vectorised view (the snapshot's `ClusterView`, built once per snapshot: its build is
  reported beside it, as it is paid once per change of the cluster, not per decision);
- `place_slowly`, the same rule node by node in plain Python (the baseline the view replaced);
- `route`: the power-of-two-choices pick among a model's warm instances.

Target (issue 14): placement ≤ 100 µs p99. Prints a table and writes bench/results/placement.json.
Usage: python bench/placement.py [--nodes 100 --models 1000 --instances 10000 --decisions 20000]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from ember.core.placement import (
    ClusterSnapshot,
    Holding,
    ModelSpec,
    NodeSnapshot,
    WarmInstance,
    place,
    place_slowly,
)

GB = 1_000_000_000
TARGET_P99_US = 100.0


def build(nodes: int, models: int, instances: int, seed: int) -> ClusterSnapshot:
    rng = random.Random(seed)
    specs = {f"m{i}:1": ModelSpec(f"m{i}:1", bytes=rng.choice([GB // 10, GB // 2, 2 * GB, 8 * GB]),
                                  memory_mb=rng.choice([500, 2000, 8000]),
                                  slice_kind="gpu" if rng.random() < 0.2 else "cpu") for i in range(models)}
    ids = [f"node-{j:03d}" for j in range(nodes)]
    holdings: list[dict[str, Holding]] = [{} for _ in ids]
    warm: list[list[WarmInstance]] = [[] for _ in ids]
    keys = list(specs)
    for k in range(instances):
        key, j = keys[k % models], rng.randrange(nodes)
        if rng.random() < 0.7:
            warm[j].append(WarmInstance(f"i{k}", ids[j], key, rng.randrange(5), 4))
        else:
            old = holdings[j].get(key, Holding())
            holdings[j][key] = Holding(old.paused + 1, old.template, specs[key].bytes)
    for key, spec in specs.items():
        for j in rng.sample(range(nodes), 3):
            old = holdings[j].get(key, Holding())
            held = rng.choice([spec.bytes, spec.bytes // 2, 0])
            holdings[j][key] = Holding(old.paused, old.template or rng.random() < 0.5, max(old.local_bytes, held))
    snapshot_nodes = tuple(
        NodeSnapshot(ids[j], memory_mb=64000, free_memory_mb=rng.randrange(0, 64000),
                     slices={"cpu": 16, "gpu": 2},
                     free_slices={"cpu": rng.randrange(0, 17), "gpu": rng.randrange(0, 3)},
                     queue=rng.randrange(0, 20), disk_bps=rng.uniform(0.5, 3) * GB, net_bps=rng.uniform(0.5, 1.25) * GB,
                     holdings=holdings[j], warm=tuple(warm[j]))
        for j in range(nodes))
    return ClusterSnapshot(nodes=snapshot_nodes, models=specs, origin_bps=0.1 * GB, service_s=0.02)


def timed(fn: Callable[[str], Any], keys: list[str], n: int, seed: int) -> np.ndarray:
    rng = random.Random(seed)
    picks = [rng.choice(keys) for _ in range(n)]
    for key in picks[:200]:   # warm up caches and numpy's dispatch
        fn(key)
    out = np.empty(n)
    clock = time.perf_counter_ns
    for k, key in enumerate(picks):
        t0 = clock()
        fn(key)
        out[k] = clock() - t0
    return out / 1000.0


def summary(us: np.ndarray) -> dict[str, float]:
    return {"n": len(us), "p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "max_us": float(us.max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--instances", type=int, default=10_000)
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "placement.json")
    args = parser.parse_args()
    snap = build(args.nodes, args.models, args.instances, args.seed)
    t0 = time.perf_counter()
    view = snap.view
    build_ms = (time.perf_counter() - t0) * 1000
    keys = list(snap.models)
    route_rng = random.Random(args.seed)
    rows = {
        "place (vectorised view)": summary(timed(lambda k: place(k, snap), keys, args.decisions, args.seed)),
        "place_slowly (plain Python)": summary(timed(lambda k: place_slowly(k, snap), keys,
                                                     max(1000, args.decisions // 10), args.seed)),
        "route (p2c among warm)": summary(timed(lambda k: view.route(k, route_rng), keys, args.decisions, args.seed)),
    }
    placed = sum(1 for k in keys if hasattr(place(k, snap), "node"))
    result = {"nodes": args.nodes, "models": args.models, "instances": args.instances, "seed": args.seed,
              "view_build_ms": build_ms, "placeable_models": placed, "target_p99_us": TARGET_P99_US,
              "met": rows["place (vectorised view)"]["p99_us"] <= TARGET_P99_US, "decisions": rows,
              "machine": {"python": platform.python_version(), "numpy": np.__version__, "cpu": platform.processor()}}
    table = Table(title=f"placement: {args.nodes} nodes, {args.models} models, {args.instances} instances "
                        f"(view built in {build_ms:.0f} ms; {placed}/{args.models} models placeable)")
    for col in ("decision", "n", "p50 µs", "p99 µs", "max µs"):
        table.add_column(col, justify="left" if col == "decision" else "right")
    for name, r in rows.items():
        table.add_row(name, str(r["n"]), f"{r['p50_us']:.1f}", f"{r['p99_us']:.1f}", f"{r['max_us']:.0f}")
    Console().print(table)
    verdict = "met" if result["met"] else "NOT met"
    print(f"target: place p99 ≤ {TARGET_P99_US:.0f} µs: {verdict}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
