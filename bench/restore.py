"""The restore rung against the node's other starts and a naive cold start: time to first response, one run.

On a real node (ember.node.local_node.LocalNode, sandbox on, `snapshots=True`), for the bundled MiniLM (and with
`--llm` SmolLM2, one greedy token of a chat), each sample starts an instance on one rung, sends one request, and
stops the instance; the time is from the start's call to the reply:
- `restore, image in page cache`: from the model's process image (CRIU: the restore, the copy entering its
  sandbox and slice, its hello, then the request);
- `restore, image evicted`: the same after the image's files are dropped from the page cache (posix_fadvise
  DONTNEED; the model's own files and libraries stay cached, as on a node that served it before);
- `zygote` and `template`: the ladder's forks, for comparison;
- `naive cold start` (MiniLM): bench/cold_start.py's baseline, a new `python` that imports sentence_transformers,
  loads the model and embeds one sentence (warm page cache).
Rungs alternate sample by sample. Also the image's size and the dump's time. Prints a table and writes
bench/results/restore.json.

Usage: python bench/restore.py [-n 20] [--naive-n 5] [--llm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from cold_start import NAIVE, SENTENCE, time_to_marker
from rich.console import Console
from rich.table import Table

from ember.core.slices import Slice
from ember.core.states import Rung
from ember.node import criu
from ember.node.local_node import LocalNode
from ember.wire.contract import ModelContract, example_contracts_dir, load_contract

RESULTS = Path(__file__).resolve().parent / "results"
RUNGS = ("restore", "restore, image evicted", "zygote", "template")


def request_of(contract: ModelContract) -> dict[str, np.ndarray]:
    arr = np.empty(1, dtype=object)
    if contract.runtime == "llm":
        arr[0] = json.dumps({"messages": [{"role": "user", "content": SENTENCE}], "max_tokens": 1,
                             "temperature": 0}).encode()
        return {"request": arr}
    arr[0] = SENTENCE.encode()
    return {"text": arr}


def evict(images: Path) -> None:
    for path in images.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


async def sample(node: LocalNode, contract: ModelContract, rung: str, slice_: Slice) -> float:
    if rung == "restore, image evicted":
        evict(node._images.path(contract))
    started = time.perf_counter()
    instance = await node.start(contract, Rung(rung.split(",")[0]), slice_)
    await node.infer(instance.instance_id, request_of(contract))
    took = time.perf_counter() - started
    await node.stop(instance.instance_id)
    return took


async def bench(contract: ModelContract, n: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    cpu = sorted(os.sched_getaffinity(0))[0]
    slice_ = Slice(id=f"cpu-{cpu}", kind="cpu", memory_mb=2048, cpus=(cpu,), threads=1)
    times: dict[str, list[float]] = {r: [] for r in RUNGS}
    with tempfile.TemporaryDirectory(prefix="ember-restore-", dir="/tmp") as state:
        node = LocalNode(state, snapshots=True)
        try:
            await node.prepare(contract)
            while not node.can_restore(contract):
                await asyncio.sleep(0.1)
            for rung in RUNGS:   # a first start of each, not counted (first touches)
                await sample(node, contract, rung, slice_)
            for _ in range(n):
                for rung in RUNGS:
                    times[rung].append(await sample(node, contract, rung, slice_))
            image = node.snapshot_status()["images"][0]
        finally:
            await node.close()
    return times, image


def pct(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"n": len(xs), "p50": statistics.median(xs), "p95": xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))],
            "min": xs[0], "max": xs[-1]}


def report(name: str, rows: dict[str, dict[str, float]], image: dict[str, Any]) -> None:
    base = rows.get("naive cold start", rows["zygote"])
    table = Table(title=f"{name}, start + first response (s); image {image.get('mb', 0):.0f} MiB, dump "
                        f"{image.get('dump_s', 0):.2f} s, CRIU {criu.find().version}")
    versus = "naive" if base is not rows["zygote"] else "zygote"
    for col in ("start", "n", "p50", "p95", "min", "max", f"p50 vs {versus}"):
        table.add_column(col)
    for label, r in rows.items():
        table.add_row(label, str(r["n"]), *(f"{r[k]:.3f}" for k in ("p50", "p95", "min", "max")),
                      f"{base['p50'] / r['p50']:.1f}x")
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20)
    parser.add_argument("--naive-n", type=int, default=5)
    parser.add_argument("--llm", action="store_true", help="SmolLM2 too (one greedy token)")
    args = parser.parse_args()
    if not criu.find().ok:
        sys.exit(f"snapshots cannot run here: {criu.find().reason}")
    out: dict[str, Any] = {}
    for name in ("minilm", *(["smollm2"] if args.llm else [])):
        contract = load_contract(example_contracts_dir() / f"{name}.yaml")
        times, image = asyncio.run(bench(contract, args.n))
        rows = {rung: pct(ts) for rung, ts in times.items()}
        if name == "minilm":
            weights = str(contract.weights_path())
            naive = [time_to_marker(NAIVE, [weights, SENTENCE], b"EMBEDDED") for _ in range(args.naive_n)]
            rows["naive cold start"] = pct([t for t in naive if t is not None])
        report(name, rows, image)
        out[name] = {"image": image, **rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "restore.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
