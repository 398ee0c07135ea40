"""What the sandbox costs a cold start: the same fork with and without it, interleaved on one machine.

Two LocalNodes, one with `sandbox=False` and one with `sandbox=True`, each with the model's zygote and
template, take turns starting an instance on the TEMPLATE and ZYGOTE rungs (start, first request, stop), so that
both see the same machine load. Reported per rung and mode: fork to first response (p50, p95), and with the
sandbox the instance's own time in it (its hello's `sandbox.seconds`: cgroup, namespaces, the read-only view,
the uid change, seccomp; the cgroup join of a template's replica overlaps its warm-up and is not in it).

With --gateway, the same comparison through two real `ember serve`s (`--sandbox off` and `--sandbox on`, the
cold-start benchmark's MiniLM variants), taking turns with one request each that lands on the template or zygote
rung: bench/cold_start.py run twice in a row is at the mercy of a shared VM's load between the runs.

Prints a table and writes JSON to bench/results/sandbox_cost.json (--gateway: sandbox_cost_gateway.json).
Usage: python bench/sandbox_cost.py [--contract PATH] [-n 20] [--gateway]
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
from ember.node.local_node import LocalNode
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


def through_gateway(n: int) -> dict[str, Any]:
    import httpx
    from cold_start import SETTLE_S, infer_once, write_variants

    from ember.testing.server import EmberServer

    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        models = Path(tmp) / "models"
        models.mkdir()
        write_variants(models)
        for other in models.glob("*.yaml"):
            if not other.stem.endswith(("-template", "-zygote")):
                other.unlink()
        servers = [EmberServer(Path(tmp) / f"state-{m}", "--models", str(models), "--cpu-slots", "2",
                               "--log-level", "warning", "--sandbox", m) for m in ("off", "on")]
        try:
            clients = {m: httpx.Client(base_url=s.start().url, timeout=120) for m, s in zip(("off", "on"), servers,
                                                                                             strict=True)}
            for rung in ("template", "zygote"):
                for client in clients.values():
                    infer_once(client, f"minilm-{rung}")
                for _ in range(n):
                    for mode, client in clients.items():
                        time.sleep(SETTLE_S[rung])
                        elapsed, landed = infer_once(client, f"minilm-{rung}")
                        if landed == rung:
                            times.setdefault(f"{rung}/{mode}", []).append(elapsed)
        finally:
            for server in servers:
                server.stop()
    return {"model": "minilm:1 (through the gateway)", "n": n,
            "fork_to_first_response": {k: pct(v) for k, v in times.items()}, "sandbox_seconds": {}}


def print_table(r: dict[str, Any]) -> None:
    print(f"sandbox cost, {r['model']}, N={r['n']} per row (fork to first response, interleaved)")
    heads = ('off p50', 'on p50', 'diff p50', 'off p95', 'on p95')
    print(f"{'rung':10} " + " ".join(f"{h:>9}" for h in heads) + f" {'in sandbox p50':>15}")
    f, s = r["fork_to_first_response"], r["sandbox_seconds"]
    for rung in ("template", "zygote"):
        off, on = f[f"{rung}/off"], f[f"{rung}/on"]
        print(f"{rung:10} {off['p50'] * 1e3:9.1f} {on['p50'] * 1e3:9.1f} {(on['p50'] - off['p50']) * 1e3:9.1f} "
              f"{off['p95'] * 1e3:9.1f} {on['p95'] * 1e3:9.1f} "
              f"{s.get(f'{rung}/on', {}).get('p50', float('nan')) * 1e3:15.2f}   ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contract", type=Path, default=example_contracts_dir() / "minilm.yaml")
    parser.add_argument("-n", type=int, default=20)
    parser.add_argument("--gateway", action="store_true", help="through two real servers instead of LocalNodes")
    args = parser.parse_args()
    result = through_gateway(args.n) if args.gateway else asyncio.run(run(load_contract(args.contract), args.n))
    RESULTS.mkdir(exist_ok=True)
    name = "sandbox_cost_gateway.json" if args.gateway else "sandbox_cost.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2))
    print_table(result)


if __name__ == "__main__":
    main()
