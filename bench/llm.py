"""LLM benchmark under the ladder: llama.cpp (SmolLM2-135M and random-weight Llamas shaped like 1B and 8B), or vLLM.

One run measures, per model, through a real `ember serve` (OpenAI streaming chat, client side):
- rungs: time to first token of requests landing on each rung (hot, paused, template fork, zygote fork; the
  `: ember-rung` comment proves where), and the rungs' overhead over hot (the p95 of each sample less hot's median);
- naive: a fresh `python` that imports llama-cpp-python, loads the same GGUF (warm page cache) and produces the
  first token of the same greedy chat;
- decode: alternating rounds (`--rounds`, after a warm-up round) on one core of tokens/s of one greedy stream
  through ember against llama.cpp used directly in-process (a long-lived bench/llamacpp_peer.py: llama_cpp.Llama,
  same GGUF, prompt and length, 1 thread as an instance runs, moved onto the ember instance's core), once with
  ember's mapped weights and once with llama.cpp's repacked ones (`options.repack`, as `Llama` loads them), and
  the aggregate of 8 streams against one; each ratio within its round, then their median and range;
- memory: what a replica adds: the private memory (USS) of each of two replicas forked from one template, after each
  served a request (the KV cells it wrote included; the weights' pages are the page cache's, shared);
- load: 16 concurrent streams of ~1,000-token prompts (distinct, no prefix hits): p50 time to first token
  against one such stream alone.
The 1B and 8B files (Q4_K, ~0.8 and ~4.9 GB; `ember.testing.gguf_models.write_shaped`) are written once into
~/.cache/ember/bench-gguf. Prints tables and writes JSON to bench/results/llm.json.

With `--engine vllm` (needs `ember env build vllm`) it measures the vllm runtime instead, SmolLM2-135M-Instruct as
a float32 Hugging Face directory (ember.testing.hf_models, written once into ~/.cache/ember/hf), through a real
`ember serve` the same way (sandbox off, as the vllm tests run):
- rungs: hot, paused and zygote (no template: a built vLLM engine holds gloo's threads, docs/llm.md), against
  vLLM's own cold start in fresh processes (bench/vllm_peer.py in the environment's interpreter: imports, engine,
  first token of the same greedy chat; `--naive-n` of them, on one core and one thread as an instance runs);
- streams: rounds of 1 and 8 concurrent greedy streams of one prompt (`--tokens` each), alternating three sides in
  one run: the vllm runtime through ember, vLLM used directly in process (a long-lived bench/vllm_peer.py pinned
  to that instance's core, the runtime's engine settings, one thread), and ember's llama.cpp engine (the bundled
  Q4_1 GGUF, one thread). Round 0 is a warm-up (kept in the JSON, not counted); the sides run in each of their six
  orders in turn (`--rounds 6` counts each once).
  Each round's ratio is taken within the round; the table gives their median and range.
Writes bench/results/llm_vllm.json.

Usage: python bench/llm.py [--engine llama.cpp|vllm] [--models smollm2,1b,8b] [-n 10] [--tokens 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from cold_start import VARIANTS, pct, time_to_marker  # bench/ is on sys.path when a benchmark runs
from llm_client import (
    CONSOLE,
    LONG,
    OPENERS,
    QUESTION,
    LinePeer,
    chat_stream,
    decode,
    rung_contract,
    sample_rung,
    spread,
)
from llm_fetch import fetch_samples
from llm_vllm import bench_vllm, report_vllm
from rich.table import Table

from ember.testing.gguf_models import smollm2_path, write_shaped
from ember.testing.server import EmberServer

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path.home() / ".cache" / "ember" / "bench-gguf"
KV_TOKENS = {"smollm2": 8192, "1b": 8192, "8b": 4096}
NAIVE = r"""
import sys
import llama_cpp
from ember.runtimes.ggml_backends import load   # the CPU backend variant for this host (stdlib only)
load()
llm = llama_cpp.Llama(model_path=sys.argv[1], n_threads=1, n_ctx=2048, verbose=False)
llm.create_chat_completion([{"role": "user", "content": sys.argv[2]}], max_tokens=1, temperature=0)
print("FIRST_TOKEN", flush=True)
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
    for rung in VARIANTS:
        data = rung_contract(name, rung, gguf)
        data["options"] = {**data.get("options", {}), "kv_tokens": KV_TOKENS[name]}
        if name != "smollm2":   # a warm-up request costs a real decode step of a big model on the rung's path:
            data["warmup"] = {**data["warmup"], "requests": 0}   # its declared prefix is restored instead
        (directory / f"{name}-{rung}.yaml").write_text(json.dumps(data))
        if rung == "hot":   # decode rounds (their own server): the hot contract, and its twin with llama.cpp's
            (directory / "decode").mkdir()   # repacked weights, as llama_cpp.Llama loads them by default
            (directory / "decode" / f"{name}-hot.yaml").write_text(json.dumps(data))
            data.update(name=f"{name}-repack", options={**data["options"], "repack": True})
            data["resources"] = {**data["resources"],   # the repacked copy is the process's own memory
                                 "memory_mb": data["resources"]["memory_mb"] + (gguf.stat().st_size >> 20)}
            (directory / "decode" / f"{name}-repack.yaml").write_text(json.dumps(data))
    pair = directory / "pair"   # two replicas of one template, for what a replica adds to memory (its own server)
    pair.mkdir()
    data.update(name=f"{name}-pair")
    data["scaling"] = {**data["scaling"], **VARIANTS["hot"], "min_scale": 2, "max_scale": 2}
    (pair / f"{name}-pair.yaml").write_text(json.dumps(data))


def decode_rounds(client: httpx.Client, server: EmberServer, name: str, gguf: Path, args: argparse.Namespace,
                  tmp: Path) -> dict[str, Any]:
    """Alternating rounds on one core: llama.cpp used directly (a long-lived bench/llamacpp_peer.py, moved onto the
    core of the ember instance it is compared with), one stream through ember (mapped weights, ember's default),
    one through ember with llama.cpp's repacked weights (as `Llama` loads them), and 8 streams through ember.
    Round 0 is a warm-up; each counted round's ratios are taken within the round."""
    hot, repack = f"{name}-hot", f"{name}-repack"
    for model in (hot, repack):
        chat_stream(client, model, "Hi", 2)
    cpus = {model: os.sched_getaffinity(instance_pid(server, model)) for model in (hot, repack)}
    peer = LinePeer([sys.executable, str(Path(__file__).resolve().parent / "llamacpp_peer.py"), str(gguf)],
                    cpus[hot], tmp / f"direct-{name}.log", "bench/llamacpp_peer.py")
    rounds = []
    try:
        for _ in range(args.rounds + 1):
            one: dict[str, Any] = {}
            for model in (hot, repack):
                os.sched_setaffinity(peer.proc.pid, cpus[model])
                one[f"direct on {model}'s core"] = peer.ask({"prompt": LONG, "tokens": args.tokens})
                one[model] = decode(client, model, 1, args.tokens)
            one[f"{hot} x8"] = decode(client, hot, 8, args.tokens)
            rounds.append(one)
    finally:
        peer.close()

    def ratios(of: Any) -> dict[str, Any]:
        each = [of(r) for r in rounds[1:]]
        return {"each": each, "median": statistics.median(each), "min": min(each), "max": max(each)}

    return {"rounds": rounds, "cpus": {m: sorted(c) for m, c in cpus.items()},
            "one_vs_direct": ratios(lambda r: r[hot]["per_stream_tokens_per_s"] /
                                    r[f"direct on {hot}'s core"]["tokens_per_s"]),
            "repack_vs_direct": ratios(lambda r: r[repack]["per_stream_tokens_per_s"] /
                                       r[f"direct on {repack}'s core"]["tokens_per_s"]),
            "eight_vs_one": ratios(lambda r: r[f"{hot} x8"]["tokens_per_s"] / r[hot]["tokens_per_s"])}


def instance_pid(server: EmberServer, model: str) -> int:
    return next(int(i["pid"]) for i in server.instances(model) if i.get("pid"))


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


def bench_model(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    gguf = gguf_of(name)
    result: dict[str, Any] = {"gguf_bytes": gguf.stat().st_size}
    naive = [t for t in (time_to_marker(NAIVE, [str(gguf), QUESTION], b"FIRST_TOKEN")
                         for _ in range(args.naive_n if "naive" in args.parts else 0)) if t]
    result["naive"] = pct(naive) if naive else {"n": 0}
    models = tmp / name
    models.mkdir()
    write_contracts(models, name, gguf)
    flags = ["--no-examples", "--log-level", "warning", "--cpu-slots", "2", "--request-timeout-s", "900"]
    if "rungs" in args.parts:   # fetch compares with the hot rung: it runs with the rungs
        with EmberServer(tmp / f"state-{name}", "--models", str(models), *flags) as server, \
                httpx.Client(base_url=server.url, timeout=900) as client:
            sampled = {rung: sample_rung(client, f"{name}-{rung}", rung, args.n) for rung in VARIANTS}
            samples = {rung: times for rung, (times, _) in sampled.items()}
            result["samples_s"] = samples
            result["rungs"] = {rung: pct(t) if t else {"n": 0} for rung, t in samples.items()}
            result["cached_tokens"] = {rung: sorted(set(c)) for rung, (_, c) in sampled.items()}
            hot = statistics.median(samples["hot"]) if samples["hot"] else float("nan")
            result["overhead_p95_s"] = {rung: pct([t - hot for t in samples[rung]])["p95"]
                                        for rung in ("paused", "template", "zygote") if samples[rung]}
            if name in args.load_models:
                result["load"] = under_load(client, f"{name}-hot")
        if args.fetch_n:
            zygote = json.loads((models / f"{name}-zygote.yaml").read_text())
            fetched = fetch_samples(name, gguf, zygote, args.fetch_n, tmp, flags, chat_stream,
                                    lambda i: f"{OPENERS[i % len(OPENERS)]} {i}: {QUESTION}")
            times = [f["ttft_s"] for f in fetched["samples"] if f["rung"] == "fetch"]
            result["fetch"] = fetched
            result["rungs"]["fetch"] = pct(times) if times else {"n": 0}
            result["overhead_p95_s"]["fetch"] = pct([t - hot for t in times])["p95"] if times else float("nan")
    if "decode" in args.parts:
        with EmberServer(tmp / f"state-{name}-decode", "--models", str(models / "decode"), *flags) as server, \
                httpx.Client(base_url=server.url, timeout=900) as client:
            result["decode"] = decode_rounds(client, server, name, gguf, args, tmp)
    if "memory" in args.parts:
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
    for column in ("model", "naive", "hot", "paused", "template", "zygote", "fetch", "tmpl - hot", "zyg - hot"):
        table.add_column(column, justify="right")
    for name, r in results.items():
        def cell(s: dict[str, Any]) -> str:
            return f"{s['p50'] * 1e3:.0f} / {s['p95'] * 1e3:.0f}" if s.get("n") else "-"
        over = r.get("overhead_p95_s", {})
        table.add_row(name, cell(r["naive"]), *(cell(r.get("rungs", {}).get(k, {})) for k in (*VARIANTS, "fetch")),
                      *(f"{over[k] * 1e3:.0f}" if k in over else "-" for k in ("template", "zygote")))
    CONSOLE.print(table)
    for name, r in results.items():
        print(f"{name}: prompt tokens found cached per rung (the declared prefix only, on every rung): "
              + ", ".join(f"{rung} {c}" for rung, c in r.get("cached_tokens", {}).items()))
        if "fetch" in r:
            f = r["fetch"]
            print(f"{name}: fetch rung: {f['bytes'] / 2**20:.0f} MiB from an origin at {f['origin_mib_s']} MiB/s over "
                  f"{f['connections']} connections (floor {f['origin_floor_s']:.2f} s), each sample a fresh node: "
                  + ", ".join(f"{x['ttft_s']:.2f} s ({x['rung']})" for x in f["samples"]))
        d = r.get("decode")
        if d is not None:
            counted = d["rounds"][1:]
            one = statistics.median(x[f"{name}-hot"]["per_stream_tokens_per_s"] for x in counted)
            direct = statistics.median(x[f"direct on {name}-hot's core"]["tokens_per_s"] for x in counted)
            print(f"{name}: decode, one stream through ember {one:.1f} tok/s, llama.cpp direct {direct:.1f} (medians): "
                  f"ember / direct {spread(d['one_vs_direct'])}; with repacked weights as direct has them "
                  f"{spread(d['repack_vs_direct'])}; 8 streams / one stream {spread(d['eight_vs_one'])}")
        m = r.get("memory", {})
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
    parser.add_argument("--engine", choices=("llama.cpp", "vllm"), default="llama.cpp")
    parser.add_argument("--models", default="smollm2,1b,8b", help="llama.cpp only (vllm: SmolLM2)")
    parser.add_argument("--load-models", default="smollm2")
    parser.add_argument("-n", type=int, default=10)
    parser.add_argument("--naive-n", type=int, default=3)
    parser.add_argument("--node-core", action="store_true",
                        help="vllm: the streams' gateways on a core of their own (--cpu-slots 1 on 2 cores)")
    parser.add_argument("--fetch-n", type=int, default=2, help="first requests from the origin, each a fresh node")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of decode/streams counted (after a warm-up)")
    parser.add_argument("--parts", default="naive,rungs,decode,memory", help="llama.cpp: which parts to run")
    parser.add_argument("--json", default="llm.json", help="llama.cpp: the results file's name in bench/results")
    args = parser.parse_args()
    args.load_models = args.load_models.split(",")
    args.parts = set(args.parts.split(","))
    results: dict[str, Any] = {}
    RESULTS.mkdir(exist_ok=True)
    if args.engine == "vllm":
        with tempfile.TemporaryDirectory(prefix="ember-llm-vllm-", dir="/tmp") as tmp:
            result = {"argv": sys.argv[1:], **bench_vllm(args, Path(tmp))}
        (RESULTS / "llm_vllm.json").write_text(json.dumps(result, indent=1) + "\n")
        report_vllm(result)
        print(f"JSON: {RESULTS / 'llm_vllm.json'}")
        return
    with tempfile.TemporaryDirectory(prefix="ember-llm-", dir="/tmp") as tmp:
        for name in args.models.split(","):
            results[name] = bench_model(name, args, Path(tmp))
            print(json.dumps({name: results[name]}, default=str)[:400], flush=True)
            (RESULTS / args.json).write_text(json.dumps(results, indent=2))   # each model's as soon as it is done
    report(results)
    (RESULTS / args.json).write_text(json.dumps(results, indent=2))
    print(f"JSON: {RESULTS / args.json}")


if __name__ == "__main__":
    main()
