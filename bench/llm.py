"""LLM benchmark on llama.cpp under the ladder: SmolLM2-135M and random-weight Llamas shaped like 1B and 8B.

One run measures, per model, through a real `ember serve` (OpenAI streaming chat, client side):
- rungs: time to first token of requests landing on each rung (hot, paused, template fork, zygote fork; the
  `: ember-rung` comment proves where), and the rungs' overhead over hot (p95 of the differences' samples);
- naive: a fresh `python` that imports llama-cpp-python, loads the same GGUF (warm page cache) and produces the
  first token of the same greedy chat;
- decode: tokens/s of one greedy stream through ember against llama.cpp used directly in-process
  (llama_cpp.Llama, same GGUF, same prompt and length, 1 thread as an instance runs), and the aggregate of 8;
- memory: the node's PSS with one hot replica and with two, less the second's KV pool: what a replica adds;
- load: 16 concurrent streams of ~1,000-token prompts (distinct, no prefix hits): p50 time to first token
  against one such stream alone.
The 1B and 8B files (Q4_K, ~0.8 and ~4.9 GB; `ember.testing.gguf_models.write_shaped`) are written once into
~/.cache/ember/bench-gguf. Prints tables and writes JSON to bench/results/llm.json.

Usage: python bench/llm.py [--models smollm2,1b,8b] [-n 10] [--tokens 64]
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
from cold_start import SETTLE_S, VARIANTS, pct, time_to_marker  # bench/ is on sys.path when a benchmark runs
from rich.console import Console
from rich.table import Table

from ember.testing.gguf_models import smollm2_path, write_shaped
from ember.testing.server import EmberServer
from ember.wire.contract import example_contracts_dir, load_contract

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path.home() / ".cache" / "ember" / "bench-gguf"
QUESTION = "What is the capital of France?"
LONG = "Write a short story about a lighthouse keeper who finds a message in a bottle."
KV_TOKENS = {"smollm2": 8192, "1b": 8192, "8b": 4096}
NAIVE = r"""
import sys
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_threads=1, n_ctx=2048, verbose=False)
llm.create_chat_completion([{"role": "user", "content": sys.argv[2]}], max_tokens=1, temperature=0)
print("FIRST_TOKEN", flush=True)
"""
DIRECT = r"""
import json, sys, time
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_threads=1, n_threads_batch=1, n_ctx=2048, verbose=False)
messages = [{"role": "user", "content": sys.argv[2]}]
llm.create_chat_completion(messages, max_tokens=4, temperature=0)
n = int(sys.argv[3])
t0, first, count = time.perf_counter(), None, 0
for chunk in llm.create_chat_completion(messages, max_tokens=n, temperature=0, stream=True):
    if chunk["choices"][0]["delta"].get("content"):
        count += 1
        first = first or time.perf_counter()
end = time.perf_counter()
print(json.dumps({"tokens": count, "tokens_per_s": (count - 1) / (end - first)}))
"""


def gguf_of(name: str) -> Path:
    if name == "smollm2":
        return smollm2_path()
    path = CACHE / f"llama-{name}-q4_k.gguf"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} (random weights, once)", flush=True)
        write_shaped(path.with_suffix(".tmp"), name).rename(path)
    return path


def write_contracts(directory: Path, name: str, gguf: Path) -> None:
    """One contract per rung (`{name}-{rung}.yaml`): the bundled SmolLM2 contract on this GGUF."""
    base = load_contract(example_contracts_dir() / "smollm2.yaml")
    for rung, scaling in VARIANTS.items():
        data = base.model_dump(mode="json", exclude={"source"})
        data.update(name=f"{name}-{rung}", weights=str(gguf))
        data["scaling"] = {**data["scaling"], **scaling, "max_scale": 1}
        data["resources"]["memory_mb"] = 4096
        data["options"] = {**data.get("options", {}), "kv_tokens": KV_TOKENS[name]}
        if name != "smollm2":   # a warm-up request costs a real decode step of a big model on the rung's path:
            data["warmup"] = {**data["warmup"], "requests": 0}   # its declared prefix is restored instead
        (directory / f"{name}-{rung}.yaml").write_text(json.dumps(data))
    pair = directory / "pair"   # two replicas of one template, for what a replica adds to memory (its own server)
    pair.mkdir()
    data.update(name=f"{name}-pair")
    data["scaling"] = {**data["scaling"], **VARIANTS["hot"], "min_scale": 2, "max_scale": 2}
    (pair / f"{name}-pair.yaml").write_text(json.dumps(data))


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
            if "error" in event:
                raise RuntimeError(f"{model}: the stream failed: {event['error']}")
            if event["choices"] and event["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    total = time.perf_counter() - t0
    return {"ttft_s": first if first is not None else total, "rung": rung, "tokens": tokens, "total_s": total}


def sample_rung(client: httpx.Client, model: str, rung: str, n: int) -> list[float]:
    """Client-side TTFT of `n` requests served on `rung`. Each asks a question no instance has seen (the chat
    template's system prompt is cached alike on every rung: the template's and a zygote child's from the
    declared prefix, a hot instance's from its own), so the rungs differ by what the ladder costs only."""
    chat_stream(client, model, QUESTION, 2)   # brings up the first instance
    times: list[float] = []
    wrong = 0
    while len(times) < n and wrong < n:
        time.sleep(SETTLE_S[rung])
        one = chat_stream(client, model, f"{QUESTION} ({rung} {len(times) + wrong})", 2)
        if one["rung"] == rung:
            times.append(one["ttft_s"])
        else:
            wrong += 1
    return times


def decode(client: httpx.Client, model: str, streams: int, tokens: int) -> dict[str, Any]:
    """Aggregate tokens/s of `streams` concurrent greedy streams, and the median per stream after its first."""
    def one(_: int) -> dict[str, Any]:
        return chat_stream(client, model, LONG, tokens)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        runs = list(pool.map(one, range(streams)))
    wall = time.perf_counter() - t0
    total = sum(r["tokens"] for r in runs)
    per_stream = [(r["tokens"] - 1) / max(1e-9, r["total_s"] - r["ttft_s"]) for r in runs if r["tokens"] > 1]
    return {"streams": streams, "tokens": total, "wall_s": wall, "tokens_per_s": total / wall,
            "per_stream_tokens_per_s": statistics.median(per_stream) if per_stream else 0.0}


def long_prompt(i: int, words: int = 350) -> str:
    """A distinct prompt of about 1,000 SmolLM2 tokens (no prefix shared with another `i`'s)."""
    vocab = ["river", "stone", "lantern", "market", "winter", "copper", "garden", "signal", "harbor", "violet"]
    return f"Request {i}: " + " ".join(vocab[(i * 7 + k * 3) % len(vocab)] + str(k % 97) for k in range(words))


def under_load(client: httpx.Client, model: str) -> dict[str, Any]:
    alone = [chat_stream(client, model, long_prompt(1000 + k), 1)["ttft_s"] for k in range(3)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        runs = list(pool.map(lambda i: chat_stream(client, model, long_prompt(i), 16), range(16)))
    ttfts = [r["ttft_s"] for r in runs]
    return {"alone_p50_s": statistics.median(alone), "concurrent_p50_s": statistics.median(ttfts),
            "concurrent_max_s": max(ttfts), "ratio": statistics.median(ttfts) / statistics.median(alone)}


def json_of(command: list[str], timeout_s: float) -> dict[str, Any]:
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": f"exit {out.returncode}: {(out.stderr or out.stdout).strip()[-300:]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def bench_model(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    gguf = gguf_of(name)
    result: dict[str, Any] = {"gguf_bytes": gguf.stat().st_size}
    naive = [t for t in (time_to_marker(NAIVE, [str(gguf), QUESTION], b"FIRST_TOKEN") for _ in range(args.naive_n))
             if t]
    result["naive"] = pct(naive) if naive else {"n": 0}
    result["direct"] = json_of([sys.executable, "-c", DIRECT, str(gguf), LONG, str(args.tokens)], 1800)
    models = tmp / name
    models.mkdir()
    write_contracts(models, name, gguf)
    flags = ["--no-examples", "--log-level", "warning", "--cpu-slots", "2", "--request-timeout-s", "900"]
    with EmberServer(tmp / f"state-{name}", "--models", str(models), *flags) as server, \
            httpx.Client(base_url=server.url, timeout=900) as client:
        samples = {rung: sample_rung(client, f"{name}-{rung}", rung, args.n) for rung in VARIANTS}
        result["rungs"] = {rung: pct(t) if t else {"n": 0} for rung, t in samples.items()}
        hot = statistics.median(samples["hot"]) if samples["hot"] else float("nan")
        result["overhead_p95_s"] = {rung: pct([t - hot for t in samples[rung]])["p95"]
                                    for rung in ("paused", "template", "zygote") if samples[rung]}
        result["decode"] = [decode(client, f"{name}-hot", k, args.tokens) for k in (1, 8)]
        if name in args.load_models:
            result["load"] = under_load(client, f"{name}-hot")
    with EmberServer(tmp / f"state-{name}-pair", "--models", str(models / "pair"), *flags) as server, \
            httpx.Client(base_url=server.url, timeout=900) as client:
        result["memory"] = replica_memory(server, client, name)
    return result


def replica_memory(server: EmberServer, client: httpx.Client, name: str) -> dict[str, Any]:
    """What a replica adds: the private memory (USS) of each of two replicas forked from one template, after
    each served a request, against the GGUF's bytes; the weights' pages are the page cache's, shared."""
    from ember.node.procinfo import memory_of

    model = f"{name}-pair"
    deadline = time.monotonic() + 600
    while len([i for i in server.instances(model) if i.get("state") in ("idle", "busy", "paused")]) < 2:
        if time.monotonic() > deadline:
            return {"error": "two replicas did not start"}
        time.sleep(1)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: chat_stream(client, model, f"{QUESTION} (pair {i})", 2), range(4)))
    replicas = [memory_of(int(i["pid"])) for i in server.instances(model) if i.get("pid")]
    return {"replicas": len(replicas), "uss_bytes": [m.uss_bytes for m in replicas],
            "pss_bytes": [m.pss_bytes for m in replicas]}


def report(results: dict[str, Any]) -> None:
    table = Table(title="Time to first token through ember (streamed chat, ms): p50 / p95; overhead over hot: p95")
    for column in ("model", "naive", "hot", "paused", "template", "zygote", "tmpl - hot", "zyg - hot"):
        table.add_column(column, justify="right")
    for name, r in results.items():
        def cell(s: dict[str, Any]) -> str:
            return f"{s['p50'] * 1e3:.0f} / {s['p95'] * 1e3:.0f}" if s.get("n") else "-"
        over = r["overhead_p95_s"]
        table.add_row(name, cell(r["naive"]), *(cell(r["rungs"][k]) for k in VARIANTS),
                      *(f"{over[k] * 1e3:.0f}" if k in over else "-" for k in ("template", "zygote")))
    Console().print(table)
    for name, r in results.items():
        one, eight = r["decode"]
        direct = r["direct"].get("tokens_per_s", float("nan"))
        print(f"{name}: decode one stream {one['per_stream_tokens_per_s']:.1f} tok/s through ember vs llama.cpp "
              f"direct {direct:.1f} ({one['per_stream_tokens_per_s'] / direct:.2f}x); 8 streams "
              f"{eight['tokens_per_s']:.1f} tok/s aggregate ({eight['tokens_per_s'] / one['tokens_per_s']:.2f}x "
              f"one stream)")
        m = r["memory"]
        if "uss_bytes" in m:
            least = min(m["uss_bytes"])
            print(f"{name}: a replica's private memory (USS) {least / 2**20:.0f} MiB = {least / r['gguf_bytes']:.1%} "
                  f"of the GGUF's {r['gguf_bytes'] / 2**20:.0f} MiB (KV cells it wrote included); replicas' PSS "
                  f"{', '.join(f'{p / 2**20:.0f}' for p in m['pss_bytes'])} MiB")
        if "load" in r:
            ld = r["load"]
            print(f"{name}: 16 concurrent ~1,000-token prompts: TTFT p50 {ld['concurrent_p50_s'] * 1e3:.0f} ms "
                  f"(max {ld['concurrent_max_s'] * 1e3:.0f}) vs {ld['alone_p50_s'] * 1e3:.0f} ms alone: "
                  f"{ld['ratio']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="smollm2,1b,8b")
    parser.add_argument("--load-models", default="smollm2")
    parser.add_argument("-n", type=int, default=10)
    parser.add_argument("--naive-n", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    args.load_models = args.load_models.split(",")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ember-llm-", dir="/tmp") as tmp:
        for name in args.models.split(","):
            results[name] = bench_model(name, args, Path(tmp))
            print(json.dumps({name: results[name]}, default=str)[:400], flush=True)
    report(results)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "llm.json").write_text(json.dumps(results, indent=2))
    print(f"JSON: {RESULTS / 'llm.json'}")


if __name__ == "__main__":
    main()
