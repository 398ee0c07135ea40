"""What bench/llm.py and bench/llm_vllm.py share: the prompts, the rung contracts' shape, a streamed chat through
`ember serve` and the rung samples and decode rounds made of them, and a peer process spoken to in JSON lines."""

from __future__ import annotations

import concurrent.futures
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from cold_start import SETTLE_S, VARIANTS  # bench/ is on sys.path when a benchmark runs
from rich.console import Console

from ember.wire.contract import example_contracts_dir, load_contract

QUESTION = "What is the capital of France?"
# Each timed rung sample opens with its own word (a different first token for every sample of a rung, up to 26):
# a hot instance's prefix cache learns the prompts it served, so questions that differed only at their end
# ("... (hot 3)" after "... (hot 2)") had all but their last tokens cached on the hot instance and not on a newly
# forked one, and the rungs' overhead counted that prefill. Now every sample reuses only the declared prefix.
OPENERS = ("Amber", "Basil", "Cobalt", "Dune", "Ember", "Fjord", "Granite", "Hazel", "Indigo", "Jasper", "Kelp",
           "Lilac", "Maple", "Nutmeg", "Onyx", "Pebble", "Quince", "Russet", "Saffron", "Thistle", "Umber",
           "Velvet", "Willow", "Xenon", "Yarrow", "Zinnia")
LONG = "Write a short story about a lighthouse keeper who finds a message in a bottle."
CONSOLE = Console(width=160)   # the tables whole in a log, not cut to 80 columns


def rung_contract(name: str, rung: str, weights: Path) -> dict[str, Any]:
    """The bundled SmolLM2 contract as `{name}-{rung}` on `weights`, with the rung's idle knobs, one replica."""
    data: dict[str, Any] = load_contract(example_contracts_dir() / "smollm2.yaml").model_dump(
        mode="json", exclude={"source"})
    data.update(name=f"{name}-{rung}", weights=str(weights))
    data["scaling"] = {**data["scaling"], **VARIANTS[rung], "max_scale": 1}
    data["resources"]["memory_mb"] = 4096
    return data


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


def spread(ratio: dict[str, Any]) -> str:
    return f"median {ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f}x over {len(ratio['each'])} rounds)"
