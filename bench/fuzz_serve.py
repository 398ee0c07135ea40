"""A fuzz of a real `ember serve` with the bundled models (SmolLM2 on llama.cpp, MiniLM, iris): valid requests of
every body route (chat, completions, generate, generate_stream, V2 infer of the LLM's `request`, embeddings, V2
infer of text and of features), with extreme but in-range sampling values, then mutated (a field replaced by any
JSON value, numbers past any range and lone surrogates included, dropped, an unknown one added; bytes cut or
spliced); one in eight re-encoded in UTF-16 or UTF-32 (with or without a byte order mark) or given a UTF-8 byte
order mark, some sent with `Prefer: respond-async`. Counts the answers by status; a 5xx, an SSE `error` event
that is not the client's fault, or a dead connection is a finding, listed with its request.

Two phases, each on a server of its own: the LLM's routes, then the encoders' (served together, the LLM's
instances hold both slots of this 2-core machine and the encoders' requests mostly wait: 202 or 429).

Usage: python bench/fuzz_serve.py [-n 20000] [--clients 8] [--seed 0]
Writes bench/results/fuzz_serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import copy
import json
import random
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from ember.testing.server import EmberServer

EXAMPLES = Path(__file__).resolve().parent.parent / "ember" / "examples"

# Values in range that broke samplers and parsers before (docs/reliability.md), and their neighbours.
EXTREMES: dict[str, list[Any]] = {
    "temperature": [0, 1e-38, 5e-324, 1e-300, 1e-6, 0.7, 1.0, 2.0, None],
    "top_p": [1e-300, 5e-324, 1e-38, 0.01, 0.5, 1.0, None],
    "seed": [0, 1, 2**63 - 1, -(2**63), 2**64, None],
    "max_tokens": [1, 2, 3, 4, None],
    "presence_penalty": [-2, 0, 2],
    "frequency_penalty": [-2, 0, 2],
    "logit_bias": [{}, {"0": 100}, {"0": -100}, {"2": 5, "3": -5}, {"99999999999": 1}],
    "n": [1, 2, None],
    "stop": [None, [], [""], ["\n"], "x", ["a", "b", "c", "d"]],
    "logprobs": [False, True, None],
    "stream": [False, False, True],
    "response_format": [{"type": "text"}, {"type": "json_object"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}],
    "user": ["u", ""],
}
_nasty = ["\ud800", "a\udfff", "\x00", "\u202e", "😀", "", " ", "é" * 40, "[" * 200]
_ints = [0, -1, 1, 2**31, 2**63, 10**30, -(10**30)]
# Placeholders written into the JSON text as bare numbers no float or machine integer holds (the first past
# Python's 4,300-digit limit on int()).
_HUGE = {"<huge:digits>": "9" * 5000, "<huge:exp>": "1e999", "<huge:int>": "1" + "0" * 400}
# What an RFC 8259 decoder may detect besides UTF-8 (by a byte order mark, or the NULs around the first character).
ENCODINGS = [("utf-8", codecs.BOM_UTF8), ("utf-16-le", b""), ("utf-16-le", codecs.BOM_UTF16_LE), ("utf-16-be", b""),
             ("utf-16-be", codecs.BOM_UTF16_BE), ("utf-32-le", b""), ("utf-32-le", codecs.BOM_UTF32_LE),
             ("utf-32-be", b""), ("utf-32-be", codecs.BOM_UTF32_BE)]


def _json_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.choice(["none", "bool", "int", "float", "str", "list", "dict"] if depth < 3 else ["int", "str"])
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([*_ints, rng.randint(-1000, 1000)])
    if kind == "float":
        return rng.choice([0.0, -0.0, 1e308, -1e308, 5e-324, float("nan"), float("inf"), rng.uniform(-5, 5)])
    if kind == "str":
        return rng.choice([*_nasty, *_HUGE, "text", "user", "system", "assistant", "tool", "developer", "smollm2"])
    if kind == "list":
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["role", "content", "type", "name", "x", ""]): _json_value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def _sampling(rng: random.Random, keys: list[str]) -> dict[str, Any]:
    return {k: rng.choice(EXTREMES[k]) for k in keys if rng.random() < 0.5}


PHASES = {   # each on a server of its own, so that both kinds of model hold slots (the LLM takes both cores' slots)
    "llm": (("smollm2",), ("chat", "chat", "completions", "generate", "generate_stream", "infer_llm")),
    "encoders": (("minilm", "iris"), ("embeddings", "infer_text", "infer_iris")),
}


def _base(rng: random.Random, routes: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """A valid request of one of the body routes, sampling values drawn from EXTREMES."""
    route = rng.choice(routes)
    if route == "chat":
        body: dict[str, Any] = {"model": "smollm2", "max_tokens": rng.randint(1, 4),
                                "messages": [{"role": rng.choice(["user", "developer", "system"]), "content": "Hi"},
                                             {"role": "user", "content": [{"type": "text", "text": "Say a word."}]}]}
        body.update(_sampling(rng, list(EXTREMES)))
        if rng.random() < 0.1:
            body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        return "/v1/chat/completions", body
    if route == "completions":
        body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": rng.randint(1, 4),
                "echo": rng.random() < 0.2}
        body.update(_sampling(rng, ["temperature", "top_p", "seed", "max_tokens", "logit_bias", "n", "stop",
                                    "stream", "presence_penalty", "frequency_penalty"]))
        if rng.random() < 0.3:
            body["logprobs"] = rng.choice([0, 1, 5, None])
        return "/v1/completions", body
    if route in ("generate", "generate_stream"):
        params = _sampling(rng, ["temperature", "top_p", "seed", "max_tokens", "stop", "logit_bias"])
        params.setdefault("max_tokens", 2)
        return f"/v2/models/smollm2/{route}", {"text_input": "Hello", "parameters": params}
    if route == "infer_llm":   # the generation request as the model's V2 input, itself a JSON text
        request = {"prompt": "Hello", "max_tokens": 2,
                   **_sampling(rng, ["temperature", "top_p", "seed", "stop", "logit_bias", "logprobs"])}
        if rng.random() < 0.5:
            _mutate(rng, request)
        data = json.dumps(request, allow_nan=True, ensure_ascii=rng.random() < 0.5)
        return "/v2/models/smollm2/infer", {"inputs": [{"name": "request", "datatype": "BYTES", "shape": [1],
                                                        "data": [data]}]}
    if route == "embeddings":
        return "/v1/embeddings", {"model": "minilm", "input": rng.choice(["a sentence", ["one", "two"], [""]])}
    if route == "infer_text":
        return "/v2/models/minilm/infer", {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2],
                                                       "data": ["hello", "world"]}]}
    return "/v2/models/iris/infer", {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 4],
                                                 "data": [5.1, 3.5, 1.4, 0.2]}]}


def _mutate(rng: random.Random, doc: Any) -> None:
    target = doc
    while True:
        nested = [v for v in (target.values() if isinstance(target, dict) else target)
                  if isinstance(v, dict | list) and v]
        if not nested or rng.random() < 0.5:
            break
        target = rng.choice(nested)
    keys = list(target) if isinstance(target, dict) else list(range(len(target)))
    action = rng.choice(["replace", "drop", "add"])
    if action == "add" or not keys:
        if isinstance(target, dict):
            target[rng.choice(["x", "extra", "temperature", "role", "\ud800"])] = _json_value(rng)
        else:
            target.append(_json_value(rng))
    elif action == "drop":
        del target[rng.choice(keys)]
    else:
        target[rng.choice(keys)] = _json_value(rng)


Request = tuple[str, bytes, bool, dict[str, str], str]   # path, body, streamed, headers, encoding


def make_request(rng: random.Random, routes: tuple[str, ...]) -> Request:
    """Half valid with extreme sampling values, half mutated; one in eight in another encoding; one in twenty of
    the unary ones asked to respond async."""
    path, doc = _base(rng, routes)
    doc = copy.deepcopy(doc)
    if rng.random() < 0.5:
        for _ in range(rng.randint(1, 3)):
            _mutate(rng, doc)
    text = json.dumps(doc, allow_nan=True, ensure_ascii=rng.random() < 0.5)
    for placeholder, number in _HUGE.items():
        text = text.replace(json.dumps(placeholder), number)
    codec, bom = rng.choice(ENCODINGS) if rng.random() < 0.125 else ("utf-8", b"")
    raw = bom + text.encode(codec, "surrogatepass")
    kind = rng.random()
    if kind < 0.05:
        raw = raw[: rng.randint(0, len(raw))]
    elif kind < 0.1:
        at = rng.randint(0, len(raw))
        raw = raw[:at] + rng.choice([b"\xff", b"\xed\xa0\x80", b"\\ud800", b"}", b"\x00", b"\xff\xfe"]) + raw[at:]
    streamed = (isinstance(doc, dict) and doc.get("stream") is True) or path.endswith("/generate_stream")
    headers = {"content-type": rng.choice(["application/json"] * 30 + ["application/json; charset=utf-16"])}
    if not streamed and rng.random() < 0.05:
        headers["prefer"] = "respond-async"
    return path, raw, streamed, headers, codec + ("+bom" if bom else "")


async def _send(client: httpx.AsyncClient, path: str, raw: bytes, streamed: bool,
                headers: dict[str, str]) -> tuple[int, str]:
    """The status, and for a 5xx or a server-side SSE error the body's start."""
    if not streamed:
        r = await client.post(path, content=raw, headers=headers)
        return r.status_code, r.text[:300] if r.status_code >= 500 else ""
    async with client.stream("POST", path, content=raw, headers=headers) as r:
        text = (await r.aread()).decode("utf-8", "replace")
    if r.status_code >= 500:
        return r.status_code, text[:300]
    for line in text.splitlines():
        if line.startswith("data:") and '"error"' in line and '"server_error"' in line:
            return 599, line[:300]     # an error event a server fault caused, after a 200
    return r.status_code, ""


async def fuzz(url: str, n: int, clients: int, seed: int, routes: tuple[str, ...]) -> dict[str, Any]:
    rng = random.Random(seed)
    requests = [make_request(rng, routes) for _ in range(n)]
    statuses: Counter[str] = Counter()
    encodings: Counter[str] = Counter()
    findings: list[dict[str, Any]] = []
    queue: asyncio.Queue[Request] = asyncio.Queue()
    for item in requests:
        queue.put_nowait(item)

    async def worker() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            while not queue.empty():
                path, raw, streamed, headers, encoding = queue.get_nowait()
                try:
                    status, body = await _send(client, path, raw, streamed, headers)
                except httpx.HTTPError as exc:
                    status, body = 0, f"{type(exc).__name__}: {exc}"
                statuses[f"{path} {status}"] += 1
                encodings[f"{encoding} {status}"] += 1
                if status >= 500 or status == 0:
                    findings.append({"path": path, "status": status, "request": raw[:400].decode("utf-8", "replace"),
                                     "answer": body})

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return {"requests": n, "clients": clients, "seed": seed, "seconds": round(time.monotonic() - started, 1),
            "statuses": dict(sorted(statuses.items())), "by_encoding": dict(sorted(encodings.items())),
            "findings": findings[:50],
            "server_errors": sum(1 for f in findings if f["status"] >= 500), "dead_connections":
            sum(1 for f in findings if f["status"] == 0)}


def warm(url: str, models: tuple[str, ...]) -> None:
    """One valid request per model until it is answered 200: the fuzz then meets warm instances, not cold
    starts (which answer 202 or 429 while no instance has room)."""
    hello = [{"role": "user", "content": "Hi"}]
    valid: list[tuple[str, dict[str, Any]]] = [
             ("/v1/chat/completions", {"model": "smollm2", "messages": hello, "max_tokens": 1}),
             ("/v1/embeddings", {"model": "minilm", "input": "warm"}),
             ("/v2/models/iris/infer",
              {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [5.1, 3.5, 1.4, 0.2]}]})]
    deadline = time.monotonic() + 180
    for path, body in valid:
        if body.get("model", path.split("/")[3] if path.startswith("/v2") else "") not in models:
            continue
        while httpx.post(url + path, json=body, timeout=120).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{path}: not served within 180 s")
            time.sleep(1)


def run_phase(name: str, n: int, clients: int, seed: int) -> dict[str, Any]:
    models, routes = PHASES[name]
    paths = [arg for m in models for arg in ("--models", str(EXAMPLES / f"{m}.yaml"))]
    with tempfile.TemporaryDirectory() as tmp:
        server = EmberServer(Path(tmp) / "state", *paths).start(ready_timeout=180)
        try:
            warm(server.url, models)
            result = asyncio.run(fuzz(server.url, n, clients, seed, routes))
            result["server_alive"] = server.proc is not None and server.proc.poll() is None
        finally:
            server.stop()
    return {"phase": name, "models": list(models), **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20_000, help="requests in all, split evenly between the phases")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    phases = [run_phase(name, args.n // len(PHASES), args.clients, args.seed + i) for i, name in enumerate(PHASES)]
    codes = sorted({int(k.rsplit(" ", 1)[1]) for p in phases for k in p["statuses"]})
    print(f"{args.n} requests, {args.clients} clients, seed {args.seed}")
    print("| phase (models) | seconds | server alive after | " + " | ".join(str(c or "no answer") for c in codes)
          + " | 5xx | dead connections |")
    print("|---" * (len(codes) + 5) + "|")
    for p in phases:
        by_code: Counter[int] = Counter()
        for key, count in p["statuses"].items():
            by_code[int(key.rsplit(" ", 1)[1])] += count
        print(f"| {p['phase']} ({', '.join(p['models'])}) | {p['seconds']} | {p['server_alive']} | "
              + " | ".join(str(by_code[c]) for c in codes) + f" | {p['server_errors']} | {p['dead_connections']} |")
    by_encoding: Counter[str] = Counter()
    for p in phases:
        by_encoding.update(p["by_encoding"])
    print("answers by the body's encoding:", ", ".join(f"{k}: {v}" for k, v in sorted(by_encoding.items())))
    for p in phases:
        for f in p["findings"][:10]:
            print(json.dumps(f)[:600])
    out = Path(__file__).resolve().parent / "results" / "fuzz_serve.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"requests": args.n, "clients": args.clients, "seed": args.seed, "phases": phases},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
