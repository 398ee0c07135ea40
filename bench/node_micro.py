"""Micro-benchmark of the node's process layer: the cost of each rung, measured through LocalNode.

For one model contract (default: the bundled MiniLM embedder) it measures, in one run:
- fork to first response per rung (TEMPLATE, ZYGOTE): `start` + the first request, N times,
  with the instance's own split (slice setup + load, warmup) from its hello;
- SIGCONT to an answered ping on a paused instance (PAUSED rung), and a plain ping for reference;
- memory: the template's PSS alone, then the PSS that each extra replica adds to the whole
  group (zygote + template + replicas: pages they share with each other move between them,
  only pages shared with unrelated processes blur the sum), and each replica's private
  pages (USS), the memory it alone holds.

Prints a table and writes JSON to bench/results/node_micro.json.
Usage: python bench/node_micro.py [--contract PATH] [-n 20] [--replicas 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ember.core.slices import Slice
from ember.core.states import Rung
from ember.node import procinfo
from ember.node.local_node import LocalNode
from ember.wire.contract import ModelContract, example_contracts_dir, load_contract
from ember.wire.tensors import warmup_inputs

RESULTS = Path(__file__).resolve().parent / "results"
MB = 1 << 20


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"p50": statistics.median(ordered), "p95": p95, "min": ordered[0], "max": ordered[-1], "n": len(ordered)}


async def rung_latency(node: LocalNode, contract: ModelContract, rung: Rung, slice_: Slice, n: int) -> dict[str, Any]:
    """Start an instance from `rung`, send one request, stop it; n times."""
    request = warmup_inputs(contract)
    first_response, ready, setup_load, warmup = [], [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        started = await node.start(contract, rung, slice_)
        await node.infer(started.instance_id, request)
        first_response.append(time.perf_counter() - t0)
        ready.append(started.time_to_ready_s)
        hello = node.startup(started.instance_id)
        setup_load.append(float(hello["load_s"]))
        warmup.append(float(hello["warmup_s"]))
        await node.stop(started.instance_id)
    return {"first_response_s": percentiles(first_response), "time_to_ready_s": percentiles(ready),
            "setup_and_load_s": percentiles(setup_load), "warmup_s": percentiles(warmup)}


async def resume_latency(node: LocalNode, contract: ModelContract, slice_: Slice, n: int) -> dict[str, Any]:
    started = await node.start(contract, Rung.TEMPLATE, slice_)
    hot = []
    for _ in range(n):
        t0 = time.perf_counter()
        await node.ping(started.instance_id)
        hot.append(time.perf_counter() - t0)
    samples = []
    for _ in range(n):
        await node.pause(started.instance_id)
        await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        await node.resume(started.instance_id)
        await node.ping(started.instance_id)
        samples.append(time.perf_counter() - t0)
    await node.stop(started.instance_id)
    return {"sigcont_to_ping_s": percentiles(samples), "hot_ping_s": percentiles(hot)}


async def replica_memory(node: LocalNode, contract: ModelContract, slices: list[Slice], k: int) -> dict[str, Any]:
    """PSS of the template alone, then what each warm replica (one request served) adds to the group."""
    template_pid = node.pids()[f"template:{contract.key}"]
    alone = procinfo.memory_of(template_pid)
    pids = [node.pids()[f"zygote:{contract.runtime}"], template_pid]
    group = [sum(procinfo.memory_of(p).pss_bytes for p in pids)]
    added, uss = [], []
    for i in range(k):
        started = await node.start(contract, Rung.TEMPLATE, slices[i % len(slices)])
        await node.infer(started.instance_id, warmup_inputs(contract))
        pids.append(started.pid)
        group.append(sum(procinfo.memory_of(p).pss_bytes for p in pids))
        added.append(group[-1] - group[-2])
        uss.append(procinfo.memory_of(started.pid).uss_bytes)
    return {
        "template_rss_mb": alone.rss_bytes / MB, "template_pss_mb": alone.pss_bytes / MB,
        "group_pss_mb": [g / MB for g in group],
        "added_pss_mb": [a / MB for a in added], "replica_uss_mb": [u / MB for u in uss],
        "added_pss_ratio": [a / alone.pss_bytes for a in added],
    }


async def run(contract: ModelContract, n: int, replicas: int) -> dict[str, Any]:
    state = tempfile.mkdtemp(prefix="ember-bench-", dir="/tmp")
    node = LocalNode(state)
    cpus = sorted(os.sched_getaffinity(0))
    slices = [Slice(id=f"cpu-{c}", kind="cpu", memory_mb=contract.resources.memory_mb, cpus=(c,)) for c in cpus]
    try:
        t0 = time.perf_counter()
        await node.prepare(contract)
        prepare_s = time.perf_counter() - t0
        result: dict[str, Any] = {"contract": contract.key, "cpus": len(cpus), "n": n, "prepare_s": prepare_s}
        result["template"] = await rung_latency(node, contract, Rung.TEMPLATE, slices[0], n)
        result["zygote"] = await rung_latency(node, contract, Rung.ZYGOTE, slices[0], n)
        result["paused"] = await resume_latency(node, contract, slices[0], max(n, 50))
        result["memory"] = await replica_memory(node, contract, slices, replicas)
        return result
    finally:
        await node.close()
        shutil.rmtree(state, ignore_errors=True)


def print_table(r: dict[str, Any]) -> None:
    ms = 1000.0
    print(f"node micro-benchmark: {r['contract']}, {r['cpus']} cpus, N={r['n']}, prepare {r['prepare_s']:.2f} s")
    print(f"{'measure':44} {'p50 ms':>9} {'p95 ms':>9} {'max ms':>9}")
    for rung in ("template", "zygote"):
        for key in ("first_response_s", "time_to_ready_s", "setup_and_load_s", "warmup_s"):
            s = r[rung][key]
            print(f"{rung + ' ' + key:44} {s['p50'] * ms:9.1f} {s['p95'] * ms:9.1f} {s['max'] * ms:9.1f}")
    for key in ("sigcont_to_ping_s", "hot_ping_s"):
        s = r["paused"][key]
        print(f"{'paused ' + key:44} {s['p50'] * ms:9.2f} {s['p95'] * ms:9.2f} {s['max'] * ms:9.2f}")
    m = r["memory"]
    print(f"template: RSS {m['template_rss_mb']:.1f} MB, PSS {m['template_pss_mb']:.1f} MB")
    for i, (added, ratio, uss) in enumerate(zip(m["added_pss_mb"], m["added_pss_ratio"], m["replica_uss_mb"],
                                              strict=True)):
        print(f"replica {i + 1}: adds {added:6.1f} MB PSS to the group = {ratio:6.1%} of the template's PSS;"
              f" its USS {uss:.1f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contract", type=Path, default=example_contracts_dir() / "minilm.yaml")
    parser.add_argument("-n", type=int, default=20, help="starts per rung (>= 20 for a p95)")
    parser.add_argument("--replicas", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = asyncio.run(run(load_contract(args.contract), args.n, args.replicas))
    print_table(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "node_micro.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
