"""The restore rung for Llamas shaped like 1B and 8B: time to first token against a hot instance, and image sizes.

On a real node (ember.node.local_node.LocalNode, sandbox on, `snapshots=True`, the node's environment for its
snapshot hosts: one thread), per shape (`--shape 1b|8b`, repeatable; random-weight Q4_K GGUFs of the real shapes,
`ember.testing.gguf_models.write_shaped`, written once into ~/.cache/ember/bench-gguf as bench/llm.py does), the
bundled SmolLM2 contract on that GGUF (its warm-up request kept, `kv_tokens` 2048) is prepared, and rounds of
samples alternate, in a rotating order:
- `hot`: one greedy token of a chat (or with `--raw-prompt` of a prompt of a few tokens, which leaves less of the
  busy VM's noise in the differences) from an instance kept running (just the request);
- `restore`: an instance started from the model's image (CRIU), then the same request;
- `zygote` and `template`: the ladder's forks, for comparison.
Each sample's prompt is new (its number first), so no instance answers from its prefix cache; the page faults the
instance takes during the request are counted (/proc/PID/stat: a restored process maps its GGUF afresh). A started
sample's time runs from the start's call to the token (the start alone, to the instance's hello, is shown too);
each round's differences to its own hot sample give the overheads (p50, p95). The image's size is set against its
GGUF and against the floor: the image of the same runtime's process with the TINY Llama (2 layers, width 64), which
is mostly the interpreter and its imports. Prints tables and writes bench/results/restore_shapes.json
(restore_shapes-raw.json with `--raw-prompt`).

Usage: python bench/restore_shapes.py [--shape 1b] [--shape 8b] [-n 10] [--kv-tokens 2048] [--raw-prompt]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from cold_start import pct
from llm import gguf_of
from rich.console import Console
from rich.table import Table

from ember.core.slices import Slice
from ember.core.states import Rung
from ember.node import criu
from ember.node.local_node import LocalNode
from ember.testing.gguf_models import write_model
from ember.wire.contract import ModelContract, example_contracts_dir, load_contract

RESULTS = Path(__file__).resolve().parent / "results"
RUNGS = ("hot", "restore", "zygote", "template")


def contract_on(name: str, gguf: Path, kv_tokens: int) -> ModelContract:
    """The bundled SmolLM2 contract on `gguf` (its warm-up kept), named `name`."""
    data: dict[str, Any] = load_contract(example_contracts_dir() / "smollm2.yaml").model_dump(
        mode="json", exclude={"source"})
    data.update(name=name, weights=str(gguf))
    data["options"] = {**data.get("options", {}), "kv_tokens": kv_tokens}
    data["resources"]["memory_mb"] = 8192
    return ModelContract.model_validate(data)


def chat(i: int, raw: bool) -> dict[str, np.ndarray]:
    """One greedy token: of a chat (its template, ~40 tokens), or of a raw prompt of a few tokens."""
    arr = np.empty(1, dtype=object)
    ask: dict[str, Any] = {"prompt": f"{i} cold"} if raw else \
        {"messages": [{"role": "user", "content": f"{i}. What does a cold start cost?"}]}
    arr[0] = json.dumps({**ask, "max_tokens": 1, "temperature": 0}).encode()
    return {"request": arr}


def faults(pid: int) -> int:
    """The process's page faults so far (minor and major): /proc/PID/stat fields 10 and 12."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7]) + int(fields[9])


class Sampler:
    def __init__(self, node: LocalNode, contract: ModelContract, slice_: Slice, raw: bool) -> None:
        self.node, self.contract, self.slice, self.raw = node, contract, slice_, raw
        self.serial, self.hot, self.hot_pid = 0, "", 0
        self.faults: dict[str, list[int]] = {r: [] for r in RUNGS}   # page faults of each sample's request
        self.starts: dict[str, list[float]] = {r: [] for r in RUNGS}   # each sample's start alone (s)

    async def start_hot(self) -> None:
        started = await self.node.start(self.contract, Rung.TEMPLATE, self.slice)
        self.hot, self.hot_pid = started.instance_id, started.pid

    async def __call__(self, rung: str) -> float:
        self.serial += 1
        request = chat(self.serial, self.raw)
        started = time.perf_counter()
        if rung == "hot":
            before = faults(self.hot_pid)
            await self.node.infer(self.hot, request)
            took = time.perf_counter() - started
            self.faults[rung].append(faults(self.hot_pid) - before)
            self.starts[rung].append(0.0)
            return took
        instance = await self.node.start(self.contract, Rung(rung), self.slice)
        self.starts[rung].append(time.perf_counter() - started)
        before = faults(instance.pid)
        await self.node.infer(instance.instance_id, request)
        took = time.perf_counter() - started
        self.faults[rung].append(faults(instance.pid) - before)
        await self.node.stop(instance.instance_id)
        return took


async def ready(node: LocalNode, contract: ModelContract, timeout_s: float = 600.0) -> None:
    await node.prepare(contract)
    deadline = time.monotonic() + timeout_s
    while not node.can_restore(contract):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{contract.name}: no image after {timeout_s:.0f} s (see the node's log)")
        await asyncio.sleep(0.2)


def images_mb(node: LocalNode) -> dict[str, dict[str, Any]]:
    return {image["model"].split(":")[0]: image for image in node.snapshot_status()["images"]}


async def bench(shapes: list[str], n: int, kv_tokens: int, raw: bool, tmp: Path) -> dict[str, Any]:
    cpu = sorted(os.sched_getaffinity(0))[0]
    slice_ = Slice(id=f"cpu-{cpu}", kind="cpu", memory_mb=8192, cpus=(cpu,), threads=1)
    tiny = contract_on("llama-tiny", write_model(tmp / "llama-tiny.gguf", "llama"), kv_tokens)
    out: dict[str, Any] = {}
    node = LocalNode(tmp / "state", snapshots=True)
    try:
        await ready(node, tiny)
        for shape in shapes:
            gguf = gguf_of(shape)
            contract = contract_on(f"llama-{shape}", gguf, kv_tokens)
            await ready(node, contract)
            sampler = Sampler(node, contract, slice_, raw)
            await sampler.start_hot()
            for rung in RUNGS:   # a first sample of each, not counted (first touches)
                await sampler(rung)
            times: dict[str, list[float]] = {r: [] for r in RUNGS}
            for i in range(n):
                for rung in RUNGS[i % len(RUNGS):] + RUNGS[:i % len(RUNGS)]:
                    times[rung].append(await sampler(rung))
                print(f"{shape} round {i + 1}/{n}: " + ", ".join(f"{r} {ts[-1]:.3f}" for r, ts in times.items()),
                      flush=True)
            await node.stop(sampler.hot)
            out[shape] = {"gguf_mb": round(gguf.stat().st_size / 2**20, 1), "times": times,   # not the first,
                          "faults": {r: fs[-n:] for r, fs in sampler.faults.items()},   # uncounted samples
                          "starts": {r: ss[-n:] for r, ss in sampler.starts.items()}}
        images = images_mb(node)
    finally:
        await node.close()
    out["floor"] = images["llama-tiny"]
    for shape in shapes:
        out[shape]["image"] = images[f"llama-{shape}"]
    return out


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    times, hot = run["times"], run["times"]["hot"]
    rows = {rung: pct(ts) for rung, ts in times.items()}
    over = {rung: pct([t - h for t, h in zip(ts, hot, strict=True)]) for rung, ts in times.items() if rung != "hot"}
    return {"rows": rows, "over_hot": over}


def report(shape: str, run: dict[str, Any], summary: dict[str, Any], floor_mb: float, args: argparse.Namespace) -> None:
    image, gguf = run["image"], run["gguf_mb"]
    prompt = "a raw prompt of a few tokens" if args.raw_prompt else "a chat"
    table = Table(title=f"Llama {shape} shape (Q4_K, {gguf:.0f} MiB GGUF, kv_tokens {args.kv_tokens}): time to "
                        f"first token of {prompt} (s), one core; CRIU {criu.find().version}")
    for col in ("rung", "n", "p50", "p95", "min", "max", "- hot, p50", "- hot, p95", "start alone, p50",
                "page faults (p50)"):
        table.add_column(col)
    for rung, r in summary["rows"].items():
        over = summary["over_hot"].get(rung)
        table.add_row(rung, str(r["n"]), *(f"{r[k]:.3f}" for k in ("p50", "p95", "min", "max")),
                      *((f"{over['p50']:+.3f}", f"{over['p95']:+.3f}") if over else ("", "")),
                      f"{statistics.median(run['starts'][rung]):.3f}" if over else "",
                      f"{statistics.median(run['faults'][rung]):.0f}")
    Console(width=170).print(table)
    sizes = Table(title=f"Llama {shape} shape: its image")
    for col in ("image MiB", "dump s", "load s", "GGUF MiB", "image / GGUF", "floor MiB (TINY)",
                "(image - floor) / GGUF"):
        sizes.add_column(col)
    sizes.add_row(f"{image['mb']:.1f}", f"{image.get('dump_s', 0):.2f}", f"{image.get('load_s', 0):.2f}",
                  f"{gguf:.0f}", f"{100 * image['mb'] / gguf:.1f}%", f"{floor_mb:.1f}",
                  f"{100 * (image['mb'] - floor_mb) / gguf:.1f}%")
    Console(width=170).print(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=("1b", "8b"), help="repeatable (default: 1b)")
    parser.add_argument("-n", type=int, default=10, help="rounds (each: one sample of every rung)")
    parser.add_argument("--kv-tokens", type=int, default=2048)
    parser.add_argument("--raw-prompt", action="store_true", help="a raw prompt of a few tokens, not a chat")
    args = parser.parse_args()
    if not criu.find().ok:
        sys.exit(f"snapshots cannot run here: {criu.find().reason}")
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="ember-restore-shapes-", dir="/tmp") as tmp:
        runs = asyncio.run(bench(args.shape or ["1b"], args.n, args.kv_tokens, args.raw_prompt, Path(tmp)))
    out: dict[str, Any] = {"uptime_before": uptime, "cores": len(os.sched_getaffinity(0)),
                           "kv_tokens": args.kv_tokens, "raw_prompt": args.raw_prompt, "floor_image": runs.pop("floor")}
    for shape, run in runs.items():
        summary = summarize(run)
        report(shape, run, summary, out["floor_image"]["mb"], args)
        out[shape] = {**run, **summary}
    out["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"load: before {out['uptime_before']}\n      after  {out['uptime_after']}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"restore_shapes{'-raw' if args.raw_prompt else ''}.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
