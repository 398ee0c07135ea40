"""What the sandbox costs a cold start: the same fork with and without it, interleaved on one machine.

Two LocalNodes, one with `sandbox=False` and one with `sandbox=True`, each with the model's zygote and
template, take turns starting an instance on the TEMPLATE and ZYGOTE rungs (start, first request, stop), so that
both see the same machine load. Reported per rung and mode: fork to first response (p50, p95), and with the
sandbox the instance's own time in it (its hello's `sandbox.seconds`: cgroup, namespaces, the read-only view,
the uid change, seccomp; the cgroup join of a template's replica overlaps its warm-up and is not in it).

Prints a table and writes JSON to bench/results/sandbox_cost.json.
Usage: python bench/sandbox_cost.py [--contract PATH] [-n 20]
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
from ember.node.local import LocalNode
from ember.wire.contract import ModelContract, example_contracts_dir, load_contract
from ember.wire.tensors import warmup_inputs

RESULTS = Path(__file__).resolve().parent / "results"


def pct(values: list[float]) -> dict[str, float]:
    xs = sorted(values)
    return {"n": len(xs), "p50": statistics.median(xs), "p95": xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]}


async def one_start(node: LocalNode, contract: ModelContract, rung: Rung, slice_: Slice) -> tuple[float, float]:
    t0 = time.perf_counter()
    started = await node.start(contract, rung, slice_)
    await node.infer(started.instance_id, warmup_inputs(contract))
    elapsed = time.perf_counter() - t0
    seconds = float(node.startup(started.instance_id).get("sandbox", {}).get("seconds", 0.0))
    await node.stop(started.instance_id)
    return elapsed, seconds


async def run(contract: ModelContract, n: int) -> dict[str, Any]:
    cpu = sorted(os.sched_getaffinity(0))[0]
    slice_ = Slice(id=f"cpu-{cpu}", kind="cpu", memory_mb=contract.resources.memory_mb, cpus=(cpu,), threads=1)
    states = {mode: tempfile.mkdtemp(prefix=f"ember-sb-{mode}-", dir="/tmp") for mode in ("off", "on")}
    nodes = {mode: LocalNode(state, sandbox=mode == "on") for mode, state in states.items()}
    times: dict[str, list[float]] = {}
    inside: dict[str, list[float]] = {}
    try:
        for node in nodes.values():
            await node.prepare(contract)
        for i in range(n + 1):
            for rung in (Rung.TEMPLATE, Rung.ZYGOTE):
                for mode, node in nodes.items():
                    elapsed, seconds = await one_start(node, contract, rung, slice_)
                    if i > 0:   # the first round warms the page cache and the code paths
                        times.setdefault(f"{rung.value}/{mode}", []).append(elapsed)
                        inside.setdefault(f"{rung.value}/{mode}", []).append(seconds)
    finally:
        for mode, node in nodes.items():
            await node.close()
            shutil.rmtree(states[mode], ignore_errors=True)
    return {"model": contract.key, "n": n,
            "fork_to_first_response": {k: pct(v) for k, v in times.items()},
            "sandbox_seconds": {k: pct(v) for k, v in inside.items() if k.endswith("/on")}}


def print_table(r: dict[str, Any]) -> None:
    print(f"sandbox cost, {r['model']}, N={r['n']} per row (fork to first response, interleaved)")
    heads = ('off p50', 'on p50', 'diff p50', 'off p95', 'on p95')
    print(f"{'rung':10} " + " ".join(f"{h:>9}" for h in heads) + f" {'in sandbox p50':>15}")
    f, s = r["fork_to_first_response"], r["sandbox_seconds"]
    for rung in ("template", "zygote"):
        off, on = f[f"{rung}/off"], f[f"{rung}/on"]
        print(f"{rung:10} {off['p50'] * 1e3:9.1f} {on['p50'] * 1e3:9.1f} {(on['p50'] - off['p50']) * 1e3:9.1f} "
              f"{off['p95'] * 1e3:9.1f} {on['p95'] * 1e3:9.1f} {s[f'{rung}/on']['p50'] * 1e3:15.2f}   ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contract", type=Path, default=example_contracts_dir() / "minilm.yaml")
    parser.add_argument("-n", type=int, default=20)
    args = parser.parse_args()
    result = asyncio.run(run(load_contract(args.contract), args.n))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sandbox_cost.json").write_text(json.dumps(result, indent=2))
    print_table(result)


if __name__ == "__main__":
    main()
