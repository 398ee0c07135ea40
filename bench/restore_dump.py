"""Hot latency while the node makes process images: MiniLM requests with and without images being made, one run.

On a real node (ember.node.local_node.LocalNode, sandbox on, `snapshots=True`), a hot MiniLM instance (forked from
its template, pinned to the first core as a one-core slice) is sent one request at a time at a fixed rate
(`--rate`, a request every 1/rate s, or at once when the last was late). Windows of `--window` seconds alternate:
- `quiet`: no image is being made;
- a `dump` window of each variant: a thread makes images of the same contract one after another into a directory
  of its own (`ember.node.snapshots.make_image`, the node's environment, as the node does: a snapshot host loads
  and warms the model, CRIU dumps it), starting none after the window's time and waiting for the one under way.
  Variants: `plain` (as the node makes them: not pinned, nice 0), `nice` (the thread that starts the snapshot host
  and CRIU at nice 19, which both inherit), `core` (that thread's affinity the cores but the instance's, which both
  inherit).
Per condition: the requests' p50/p99 and the p99 ratio to the quiet windows' (all of them, and within each round
against the quiet window just before it: median), and the requests that overlapped a CRIU dump proper (its
`dump_s` before the make's end). Prints a table and writes bench/results/restore_dump.json.

Usage: python bench/restore_dump.py [--rounds 3] [--window 15] [--rate 20] [--variants plain,nice,core]
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
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from restore import request_of
from rich.console import Console
from rich.table import Table

from ember.core.slices import Slice
from ember.core.states import Rung
from ember.node import criu, snapshots
from ember.node.local_node import LocalNode
from ember.wire.contract import ModelContract, example_contracts_dir, load_contract

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("plain", "nice", "core")


@dataclass
class Dumper:
    """Makes images of `contract` one after another while `running` is set (a thread of its own)."""

    contract: ModelContract
    directory: Path
    env: dict[str, str]
    variant: str
    instance_cpus: set[int]
    made: list[dict[str, float]] = field(default_factory=list)
    running: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def run(self) -> None:
        tid = threading.get_native_id()   # what this thread starts inherits its niceness and affinity
        if self.variant == "nice":
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        if self.variant == "core":
            os.sched_setaffinity(tid, (os.sched_getaffinity(0) - self.instance_cpus) or os.sched_getaffinity(0))
        try:
            while self.running.is_set():
                began = time.perf_counter()
                image = snapshots.make_image(self.contract, self.directory / "image", env=self.env)
                self.made.append({"began": began, "ended": time.perf_counter(), "load_s": image.load_s,
                                  "dump_s": image.dump_s, "mb": image.bytes / 2**20})
        except BaseException as err:
            self.error = err


async def requests(node: LocalNode, instance: str, contract: ModelContract, until: threading.Event | float,
                   rate: float) -> list[tuple[float, float]]:
    """(start, latency) of requests sent one at a time every 1/rate s until the time `until`, or while the event
    `until` is set."""
    done: list[tuple[float, float]] = []
    request, period, next_at = request_of(contract), 1.0 / rate, time.perf_counter()

    def going() -> bool:
        return until.is_set() if isinstance(until, threading.Event) else time.perf_counter() < until

    while going():
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        started = time.perf_counter()
        await node.infer(instance, request)
        done.append((started, time.perf_counter() - started))
        next_at = max(started + period, time.perf_counter())
    return done


async def dump_window(node: LocalNode, instance: str, contract: ModelContract, dumper: Dumper, window: float,
                      rate: float) -> list[tuple[float, float]]:
    dumper.running.set()
    thread = threading.Thread(target=dumper.run, daemon=True)
    thread.start()
    alive = threading.Event()
    alive.set()
    sending = asyncio.ensure_future(requests(node, instance, contract, alive, rate))
    await asyncio.sleep(window)
    dumper.running.clear()
    await asyncio.to_thread(thread.join)
    alive.clear()
    sent = await sending
    if dumper.error is not None:
        raise RuntimeError(f"making an image failed: {dumper.error}") from dumper.error
    return sent


async def bench(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    cpu = sorted(os.sched_getaffinity(0))[0]
    slice_ = Slice(id=f"cpu-{cpu}", kind="cpu", memory_mb=2048, cpus=(cpu,), threads=1)
    contract = load_contract(example_contracts_dir() / "minilm.yaml")
    node = LocalNode(tmp / "state", snapshots=True)
    windows: list[dict[str, Any]] = []
    dumpers = {v: Dumper(contract, tmp / f"dumps-{v}", node._env(), v, {cpu}) for v in args.variants}
    try:
        await node.prepare(contract)
        while not node.can_restore(contract):   # the node's own image made first: no make overlaps the windows
            await asyncio.sleep(0.2)
        instance = (await node.start(contract, Rung.TEMPLATE, slice_)).instance_id
        await requests(node, instance, contract, time.perf_counter() + 2.0, args.rate)   # warm, not counted
        for r in range(args.rounds):
            for variant in args.variants:
                quiet = await requests(node, instance, contract, time.perf_counter() + args.window, args.rate)
                windows.append({"round": r, "condition": "quiet", "requests": quiet})
                made_before = len(dumpers[variant].made)
                sent = await dump_window(node, instance, contract, dumpers[variant], args.window, args.rate)
                windows.append({"round": r, "condition": variant, "requests": sent,
                                "made": dumpers[variant].made[made_before:]})
                print(f"round {r + 1}/{args.rounds} {variant}: quiet p99 {p99([lat for _, lat in quiet]):.4f}, "
                      f"making p99 {p99([lat for _, lat in sent]):.4f} ({len(sent)} requests, "
                      f"{len(dumpers[variant].made) - made_before} images)", flush=True)
        await node.stop(instance)
    finally:
        await node.close()
    return {"windows": windows, "instance_cpu": cpu}


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))] if xs else float("nan")


def in_dump(start: float, latency: float, made: list[dict[str, float]]) -> bool:
    return any(start < m["ended"] and start + latency > m["ended"] - m["dump_s"] for m in made)


def summarize(windows: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    def lat(ws: list[dict[str, Any]]) -> list[float]:
        return [latency for w in ws for _, latency in w["requests"]]

    quiet = lat([w for w in windows if w["condition"] == "quiet"])
    rows: dict[str, Any] = {"quiet": {"n": len(quiet), "p50": statistics.median(quiet), "p99": p99(quiet)}}
    for variant in variants:
        mine = [w for w in windows if w["condition"] == variant]
        before = [windows[windows.index(w) - 1] for w in mine]
        xs = lat(mine)
        dumping = [latency for w in mine for start, latency in w["requests"] if in_dump(start, latency, w["made"])]
        made = [m for w in mine for m in w["made"]]
        rows[variant] = {
            "n": len(xs), "p50": statistics.median(xs), "p99": p99(xs), "p99_ratio": p99(xs) / rows["quiet"]["p99"],
            "p99_ratio_by_round": [p99(lat([w])) / p99(lat([b])) for w, b in zip(mine, before, strict=True)],
            "during_criu_dump": {"n": len(dumping), "p50": statistics.median(dumping) if dumping else None,
                                 "p99": p99(dumping) if dumping else None},
            "images": len(made), "load_s": statistics.median([m["load_s"] for m in made]) if made else None,
            "dump_s": statistics.median([m["dump_s"] for m in made]) if made else None}
    return rows


def report(rows: dict[str, Any], args: argparse.Namespace, cores: int) -> None:
    table = Table(title=f"MiniLM hot requests (one at a time, {args.rate:g}/s) while images are made on the node: "
                        f"{args.rounds} rounds of {args.window:g} s windows; {cores} cores, instance on one")
    for col in ("condition", "requests", "p50 ms", "p99 ms", "p99 / quiet", "by round: median (range)",
                "in a CRIU dump: n, p99 ms", "images (load s, dump s)"):
        table.add_column(col)
    for name, r in rows.items():
        if name == "quiet":
            table.add_row("quiet", str(r["n"]), f"{1e3 * r['p50']:.1f}", f"{1e3 * r['p99']:.1f}", "", "", "", "")
            continue
        dump = r["during_criu_dump"]
        table.add_row(name, str(r["n"]), f"{1e3 * r['p50']:.1f}", f"{1e3 * r['p99']:.1f}", f"{r['p99_ratio']:.2f}x",
                      f"{statistics.median(r['p99_ratio_by_round']):.2f}x ({min(r['p99_ratio_by_round']):.2f}-"
                      f"{max(r['p99_ratio_by_round']):.2f})",
                      f"{dump['n']}, {1e3 * dump['p99']:.1f}" if dump["n"] else "0",
                      f"{r['images']} ({r['load_s']:.2f}, {r['dump_s']:.2f})" if r["images"] else "0")
    Console(width=170).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=15.0, help="seconds per window")
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second (one at a time)")
    parser.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = parser.parse_args()
    if not criu.find().ok:
        sys.exit(f"snapshots cannot run here: {criu.find().reason}")
    if unknown := set(args.variants) - set(VARIANTS):
        sys.exit(f"--variants: unknown {sorted(unknown)} (of {', '.join(VARIANTS)})")
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="ember-restore-dump-", dir="/tmp") as tmp:
        run = asyncio.run(bench(args, Path(tmp)))
    rows = summarize(run["windows"], args.variants)
    cores = len(os.sched_getaffinity(0))
    report(rows, args, cores)
    after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"load: before {uptime}\n      after  {after}")
    for w in run["windows"]:   # each request's latency (ms), in order; the makes' times from the run's start
        w["requests_ms"] = [round(1e3 * latency, 2) for _, latency in w.pop("requests")]
    RESULTS.mkdir(exist_ok=True)
    head = json.dumps({"args": vars(args), "cores": cores, "uptime_before": uptime, "uptime_after": after,
                       "summary": rows, "instance_cpu": run["instance_cpu"]}, indent=2)
    windows = ",\n".join(f"    {json.dumps(w)}" for w in run["windows"])   # one line each
    (RESULTS / "restore_dump.json").write_text(f'{head[:-2]},\n  "windows": [\n{windows}\n  ]\n}}\n')


if __name__ == "__main__":
    main()
