"""A burst of concurrent chat streams on the bundled SmolLM2, through `ember serve` with default settings.

Per tree (this checkout, and each `--base NAME=PATH`, e.g. a `git worktree` of an older commit), one `ember serve`
of the bundled smollm2 contract alone, default flags. First `--alone` streams one after another (the first brings the
instance up and is not counted), each a distinct prompt of about 340 tokens: time to first token alone. Then
`--streams` such streams at once (distinct prompts, no prefix shared): time to first token of each (client side), and
per instance of the model the requests it served and the CPU seconds it used during the burst (its process's utime
and stime): whether the burst used both cores. The trees run one after another, `--rounds` times, alternating, so
their ratio is taken within a round. Prints a table and writes bench/results/llm_burst.json.

Usage: python bench/llm_burst.py --base base=/tmp/base45b [--streams 16] [--max-tokens 64] [--rounds 1]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from llm_client import CONSOLE, chat_stream  # bench/ is on sys.path when a benchmark runs
from rich.table import Table

from ember.testing.server import EmberServer

RESULTS = Path(__file__).resolve().parent / "results"
HERE = Path(__file__).resolve().parent.parent
VOCAB = ["river", "stone", "lantern", "market", "winter", "copper", "garden", "signal", "harbor", "violet"]


def prompt(i: int, words: int) -> str:
    """A distinct prompt (about 3 SmolLM2 tokens a word): its first words differ from every other `i`'s."""
    return f"Request {i}: " + " ".join(VOCAB[(i * 7 + k * 3) % len(VOCAB)] + str((k + i) % 97) for k in range(words))


def cpu_s(pid: int) -> float:
    """The process's user and system CPU seconds so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def instances(server: EmberServer) -> dict[str, dict[str, Any]]:
    return {i["id"]: i for i in server.instances("smollm2")}


def stream(client: httpx.Client, text: str, max_tokens: int) -> dict[str, Any]:
    """One stream of the burst; a failed one (its deadline passed on a loaded VM, ...) is counted, not fatal."""
    try:
        return chat_stream(client, "smollm2", text, max_tokens)
    except (RuntimeError, httpx.HTTPError) as err:
        return {"error": str(err)}


def burst(server: EmberServer, client: httpx.Client, args: argparse.Namespace, salt: int) -> dict[str, Any]:
    for k in range(args.alone + 1):   # the first brings the instance up
        one = chat_stream(client, "smollm2", prompt(salt + 1000 + k, args.words), 1)
        if k == 0:
            alone: list[float] = []
            prompt_tokens = one["prompt_tokens"]
        else:
            alone.append(one["ttft_s"])
    before = instances(server)
    cpu0 = {i["pid"]: cpu_s(i["pid"]) for i in before.values() if i.get("pid")}
    assert server.proc is not None
    gateway0, t0 = cpu_s(server.proc.pid), time.perf_counter()
    seen: dict[str, dict[str, Any]] = {}
    with concurrent.futures.ThreadPoolExecutor(args.streams) as pool:
        futures = [pool.submit(stream, client, prompt(salt + i, args.words), args.max_tokens)
                   for i in range(args.streams)]
        while not all(f.done() for f in futures):   # instances as they come (a recycled one would leave no trace)
            for iid, inst in instances(server).items():
                if inst.get("pid"):
                    seen[iid] = inst
                    seen[iid]["cpu_s"] = cpu_s(inst["pid"])
            time.sleep(5.0)   # a status reads every instance's memory: not so often that it slows them
        results = [f.result() for f in futures]
    wall, gateway = time.perf_counter() - t0, cpu_s(server.proc.pid) - gateway0
    after = instances(server)
    per_instance = []
    for iid, inst in {**seen, **after}.items():
        pid = inst.get("pid")
        used = (cpu_s(pid) if pid and iid in after else inst.get("cpu_s", 0.0)) - cpu0.get(pid, 0.0)
        served = after.get(iid, inst)["served"] - before.get(iid, {"served": 0})["served"]
        per_instance.append({"id": iid, "slice": inst["slice"], "rung": inst["rung"], "served": served,
                             "cpu_s": round(used, 2)})
    runs = [r for r in results if "error" not in r]
    ttft = sorted(r["ttft_s"] for r in runs) or [float("nan")]
    p50 = statistics.median(ttft)
    return {"prompt_tokens": prompt_tokens, "alone_ttft_s": alone, "alone_p50_s": statistics.median(alone),
            "ttft_s": ttft, "p50_s": p50, "max_s": ttft[-1], "max_over_p50": ttft[-1] / p50,
            "rungs": sorted({r["rung"] for r in runs}), "tokens": sum(r["tokens"] for r in runs),
            "failed": [r["error"] for r in results if "error" in r],
            "instances": per_instance, "cores_used": sum(1 for i in per_instance if i["cpu_s"] >= 1.0),
            "wall_s": wall, "gateway_cpu_s": gateway}


def run_tree(name: str, tree: Path, args: argparse.Namespace, tmp: Path, salt: int) -> dict[str, Any]:
    models = tmp / f"models-{name}-{salt}"
    models.mkdir()
    shutil.copy(tree / "ember" / "examples" / "smollm2.yaml", models / "smollm2.yaml")
    env = {"PYTHONPATH": str(tree)}
    with EmberServer(tmp / f"state-{name}-{salt}", "--models", str(models), "--log-level", "warning",
                     cwd=tree, env=env) as server, httpx.Client(base_url=server.url, timeout=900) as client:
        result = burst(server, client, args, salt)
    result["commit"] = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                                      text=True).stdout.strip()
    return result


def report(rounds: list[dict[str, dict[str, Any]]], this: str) -> None:
    table = Table(title="Burst of concurrent streams on smollm2 (time to first token, s)")
    for col in ("round", "tree", "commit", "prompt tok", "alone p50", "burst p50", "max", "max/p50", "failed",
                "this p50 vs", "served per instance", "CPU s per instance", "gateway CPU s", "wall s", "cores"):
        table.add_column(col)
    for k, r in enumerate(rounds):
        for name, v in r.items():
            ratio = ", ".join(f"{v['p50_s'] / b['p50_s']:.2f}x {n}" for n, b in r.items() if n != name) \
                if name == this else ""
            table.add_row(str(k), name, v["commit"], str(v["prompt_tokens"]), f"{v['alone_p50_s']:.2f}",
                          f"{v['p50_s']:.2f}", f"{v['max_s']:.2f}", f"{v['max_over_p50']:.2f}", str(len(v["failed"])),
                          ratio,
                          " / ".join(str(i["served"]) for i in v["instances"]),
                          " / ".join(f"{i['cpu_s']:.0f}" for i in v["instances"]), f"{v['gateway_cpu_s']:.0f}",
                          f"{v['wall_s']:.0f}", str(v["cores_used"]))
    CONSOLE.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", action="append", default=[], help="NAME=PATH of another tree to compare with")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--words", type=int, default=110, help="prompt words (110: about 340 tokens)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="tokens each burst stream may generate (the contract's default is 512, which a loaded "
                             "2-core VM does not finish for 16 streams within its 300 s request timeout)")
    parser.add_argument("--alone", type=int, default=3, help="streams alone before the burst (counted)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "llm_burst.json"))
    args = parser.parse_args()
    trees = {"this": HERE, **{b.split("=", 1)[0]: Path(b.split("=", 1)[1]).resolve() for b in args.base}}
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            order = list(trees.items()) if k % 2 == 0 else list(reversed(trees.items()))
            rounds.append({name: run_tree(name, tree, args, Path(tmp), 100 * k) for name, tree in order})
            report(rounds, "this")
    out = {"args": vars(args), "uptime": os.getloadavg(), "rounds": rounds}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
