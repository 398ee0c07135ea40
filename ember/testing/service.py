"""A fake serving core: real contracts, deterministic in-process models, switchable failures.

`FakeService` implements `ember.gateway.service.Service` without processes or weights:
- `embedder` (`text` BYTES [-1] -> `embedding` FP32 [-1, D], `token_count` INT64 [-1]):
  each text maps to a unit vector seeded by its SHA-256, so equal texts embed equally;
- `affine` (`x` FP32 [-1, 3] -> `y` = 2x + 1, `norm` FP64 [-1] = row L2 norms of y);
- `echo` (`text` BYTES [-1] -> `upper` BYTES [-1], `length` INT32 [-1]);
- `chatter` (the `llm` convention, `docs/llm-convention.md`: `request` JSON -> one reply per word of the last
  message; its log-probabilities with `logprobs`; the prompt first with `echo`; with `tools` a call of each tool
  the last message names, else of the first, its arguments made from the tool's schema, answered in words once
  the last message is the tool's; with a JSON `response_format`, a JSON document of the schema's shape).
Switches: `no_capacity` (infer queues a real job in the JobStore and answers JobAccepted, or
raises Overloaded for `when_full="reject"`; `run_jobs()` completes them), `failure` (raised by the
next infers), `delay_s` (awaited before answering, and before a stream's claim; a withdrawn request counts in
`withdrawn`), `first_reply_delay_s` (a stream's first reply that long after its claim), per-model readiness via
load/unload.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ember.core.states import Rung
from ember.errors import JobNotFound, ModelFailed, ModelNotFound, ModelNotReady, Overloaded
from ember.jobs.store import JobStore
from ember.serving.results import (
    InferResult,
    InferStream,
    JobAccepted,
    JobStatus,
    ModelStatus,
    OnClaim,
    RepositoryEntry,
    WhenFull,
)
from ember.wire.contract import ModelContract, parse_contract
from ember.wire.tensors import Tensors, validate_inputs

EMBED_DIM = 8


def fake_contracts(dim: int = EMBED_DIM) -> list[ModelContract]:
    return [
        parse_contract({
            "name": "embedder", "runtime": "sentence-transformers",
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [-1, dim]},
                        {"name": "token_count", "datatype": "INT64", "shape": [-1]}],
        }),
        parse_contract({
            "name": "affine", "runtime": "python", "entrypoint": "fake:Affine",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 3]},
                        {"name": "norm", "datatype": "FP64", "shape": [-1]}],
        }),
        parse_contract({
            "name": "chatter", "runtime": "python", "entrypoint": "fake:Chatter",
            "inputs": [{"name": "request", "datatype": "BYTES", "shape": [1]}],
            "outputs": [{"name": "text", "datatype": "BYTES", "shape": [1]},
                        {"name": "finish_reason", "datatype": "BYTES", "shape": [1]},
                        {"name": "prompt_tokens", "datatype": "INT64", "shape": [1]},
                        {"name": "completion_tokens", "datatype": "INT64", "shape": [1]},
                        {"name": "logprobs", "datatype": "BYTES", "shape": [1]},
                        {"name": "tool_calls", "datatype": "BYTES", "shape": [1]}],
        }),
        parse_contract({
            "name": "echo", "runtime": "python", "entrypoint": "fake:Echo",
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": "upper", "datatype": "BYTES", "shape": [-1]},
                        {"name": "length", "datatype": "INT32", "shape": [-1]}],
        }),
    ]


def fake_embedding(text: bytes, dim: int = EMBED_DIM) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(text).digest()[:8], "little")
    vec = np.random.default_rng(seed).standard_normal(dim)
    return (vec / np.linalg.norm(vec)).astype(np.float32)


def fake_generation(request: bytes) -> list[Tensors]:
    """`chatter`: echoes the last message (or the prompt) word by word, one reply per word, honouring
    `max_tokens` (then finish_reason "length") and `stop`; see the module docstring for the rest."""
    body = json.loads(request)
    last = body["messages"][-1] if "messages" in body else {"role": "user", "content": body["prompt"]}
    source = last["content"] or ""
    prompt_tokens = len(source.split()) + 3
    if body.get("tools") and body.get("tool_choice") != "none" and last["role"] != "tool":
        return _tool_replies(body, source, prompt_tokens)
    if last["role"] == "tool":
        source = "the tool said " + source
    fmt = body.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        source = json.dumps(_example(fmt["json_schema"]["schema"], source))
    elif fmt.get("type") == "json_object":
        source = json.dumps({"text": source})
    words = [w + " " for w in source.split()]
    limit, finish = body.get("max_tokens", len(words)), "stop"
    if limit < len(words):
        words, finish = words[:limit], "length"
    stops = [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop") or []
    replies = []
    for word in words:
        if any(s in word for s in stops):
            break
        replies.append(word)
    top = body.get("top_logprobs", 0) if body.get("logprobs") else -1
    out = [_echoed(body["prompt"], prompt_tokens, top)] if body.get("echo") else []
    for i, word in enumerate(replies or [""]):
        last_one = i == len(replies or [""]) - 1
        out.append(_reply(word, [_entry(word, -0.25 * (i + 1), top)] if word else [], prompt_tokens,
                          i + 1 if replies else 0, top, finish if last_one else ""))
    return out


def _echoed(prompt: str, prompt_tokens: int, top: int) -> Tensors:
    """The prompt as the first reply, with its tokens' logprobs (the first token's null)."""
    tokens: list[str] = re.findall(r"^\s+|\S+\s*", prompt)
    entries = [_entry(t, None if i == 0 else -0.5 * i, top) for i, t in enumerate(tokens)]
    return _reply(prompt, entries, prompt_tokens, 0, top)


def _entry(token: str, logprob: float | None, top: int) -> dict[str, Any]:
    """OpenAI's chat logprobs entry: the token first among its `top` alternatives."""
    alternatives = [(token, logprob or 0.0), *((f"alt{k}", (logprob or 0.0) - k) for k in range(1, top))]
    tops = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in alternatives[:max(top, 0)]]
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": tops if logprob is not None else []}


def _reply(text: str, entries: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int, top: int,
           finish: str = "", calls: list[dict[str, Any]] | None = None) -> Tensors:
    return {"text": _bytes([text.encode()]), "finish_reason": _bytes([finish.encode()]),
            "prompt_tokens": np.array([prompt_tokens], np.int64),
            "completion_tokens": np.array([completion_tokens], np.int64),
            "logprobs": _bytes([json.dumps(entries).encode() if top >= 0 else b""]),
            "tool_calls": _bytes([json.dumps(calls).encode() if calls else b""])}


def _tool_replies(body: dict[str, Any], source: str, prompt_tokens: int) -> list[Tensors]:
    """Calls of every tool the text names (the first tool if none, the chosen one if one is), one empty reply
    before the last, which carries them (as the convention streams them)."""
    tools = [t["function"] for t in body["tools"]]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        tools = [t for t in tools if t["name"] == choice["function"]["name"]]
    named = [t for t in tools if t["name"] in source] or tools[:1]
    arguments = [json.dumps(_example(t.get("parameters") or {}, source)) for t in named]
    calls = [{"id": f"call_{i}_{t['name']}", "type": "function", "function": {"name": t["name"], "arguments": a}}
             for i, (t, a) in enumerate(zip(named, arguments, strict=True))]
    tokens = sum(len(a.split()) for a in arguments)
    top = body.get("top_logprobs", 0) if body.get("logprobs") else -1
    return [_reply("", [], prompt_tokens, 1, top),
            _reply("", [], prompt_tokens, tokens, top, "tool_calls", calls)]


def _example(schema: dict[str, Any], text: str, root: dict[str, Any] | None = None) -> Any:
    """A value of the JSON schema's shape, made from `text` (strings are the text, integers its word count)."""
    root = root or schema
    if "$ref" in schema:
        return _example(root.get("$defs", {}).get(schema["$ref"].rsplit("/", 1)[-1], {}), text, root)
    if "enum" in schema:
        return schema["enum"][0]
    if "anyOf" in schema:
        return _example(schema["anyOf"][0], text, root)
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if kind == "object":
        return {k: _example(v, text, root) for k, v in schema.get("properties", {}).items()}
    if kind == "array":
        return [_example(schema.get("items") or {}, text, root)]
    return {"integer": len(text.split()), "number": float(len(text)), "boolean": True, "null": None}.get(
        kind if isinstance(kind, str) else "string", text)


def _bytes(items: list[bytes]) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    return arr


def run_fake_model(contract: ModelContract, inputs: Tensors) -> Tensors:
    """The deterministic model behind each fake contract (`chatter`'s replies concatenated)."""
    if contract.name == "chatter":
        replies = fake_generation(bytes(inputs["request"][0]))
        return {name: np.concatenate([r[name] for r in replies]) for name in replies[0]}
    if contract.name == "embedder":
        texts = [bytes(t) for t in inputs["text"].reshape(-1)]
        dim = contract.outputs[0].shape[1]
        emb = np.stack([fake_embedding(t, dim) for t in texts]) if texts else np.zeros((0, dim), np.float32)
        return {"embedding": emb, "token_count": np.array([len(t.split()) + 2 for t in texts], dtype=np.int64)}
    if contract.name == "affine":
        y = (inputs["x"] * 2 + 1).astype(np.float32)
        return {"y": y, "norm": np.linalg.norm(y.astype(np.float64), axis=1)}
    if contract.name == "echo":
        texts = [bytes(t) for t in inputs["text"].reshape(-1)]
        upper = np.empty(len(texts), dtype=object)
        upper[:] = [t.upper() for t in texts]
        return {"upper": upper, "length": np.array([len(t) for t in texts], dtype=np.int32)}
    raise ModelNotReady(f"model '{contract.key}': the fake service has no model by that name")


@dataclass
class Call:
    model: str
    inputs: Tensors
    respond_async: bool
    when_full: WhenFull = "job"
    idempotency_key: str | None = None
    tenant: str | None = None


@dataclass
class FakeService:
    """Implements Service. Attributes are the switches; see the module docstring."""

    models: list[ModelContract] = field(default_factory=fake_contracts)
    jobs: JobStore | None = None
    no_capacity: bool = False
    failure: BaseException | None = None
    delay_s: float = 0.0
    ready: bool = True
    job_retry_after_s: float = 2.0
    unloaded: set[str] = field(default_factory=set)
    calls: list[Call] = field(default_factory=list)
    withdrawn: int = 0
    reply_delay_s: float = 0.0           # between a stream's replies
    first_reply_delay_s: float = 0.0     # between a stream's claim (on_claim told) and its first reply
    fail_stream_after: int | None = None  # a stream raises ModelFailed instead of this reply
    closed_streams: int = 0

    def contracts(self) -> list[ModelContract]:
        return list(self.models)

    def contract(self, name: str, version: str | None = None) -> ModelContract:
        found = [c for c in self.models if c.name == name and (version is None or c.version == version)]
        if not found:
            raise ModelNotFound.absent(name, version)
        return max(found, key=lambda c: c.version)

    def model_ready(self, name: str, version: str | None = None) -> bool:
        return self.ready and self.contract(name, version).name not in self.unloaded

    def server_ready(self) -> bool:
        return self.ready and all(c.name not in self.unloaded for c in self.models)

    async def infer(
        self, contract: ModelContract, inputs: Tensors, *, respond_async: bool = False, when_full: WhenFull = "job",
        tenant: str | None = None,
        idempotency_key: str | None = None,
    ) -> InferResult | JobAccepted:
        validate_inputs(contract, inputs)
        self.calls.append(Call(contract.name, inputs, respond_async, when_full, idempotency_key, tenant))
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.withdrawn += 1   # the gateway withdrew the request (its client left)
            raise
        if self.failure is not None:
            raise self.failure
        if contract.name in self.unloaded:
            raise ModelNotReady(f"model '{contract.key}': unloaded")
        if self.no_capacity and when_full == "reject" and not respond_async:
            raise Overloaded(f"model '{contract.key}': every instance is full", retry_after=self.job_retry_after_s)
        if self.no_capacity or respond_async:
            job_id = self._store().submit(contract.name, contract.version, inputs, tenant, idempotency_key)
            return JobAccepted(job_id, self.job_retry_after_s)
        return InferResult(outputs=run_fake_model(contract, inputs), rung=Rung.HOT, instance_id="fake-0")

    async def stream(self, contract: ModelContract, inputs: Tensors, *, when_full: WhenFull = "reject",
                     tenant: str | None = None, on_claim: OnClaim | None = None) -> InferStream:
        result = await self.infer(contract, inputs, when_full=when_full, tenant=tenant)
        assert isinstance(result, InferResult)
        if on_claim is not None:
            on_claim(result.rung, result.instance_id)
        if self.first_reply_delay_s:
            await asyncio.sleep(self.first_reply_delay_s)   # returns with the first reply, as the real one does
        replies = fake_generation(bytes(inputs["request"][0])) if contract.name == "chatter" else [result.outputs]

        async def each() -> AsyncGenerator[Tensors, None]:
            for i, reply in enumerate(replies):
                if i == self.fail_stream_after:
                    raise ModelFailed(f"model '{contract.key}': failed mid-stream (told to)")
                yield reply
                await asyncio.sleep(self.reply_delay_s)

        closed_once: list[bool] = []

        def closed() -> None:   # InferStream.on_close may be called more than once, as the real one allows
            if not closed_once:
                closed_once.append(True)
                self.closed_streams += 1

        return InferStream(result.rung, result.instance_id, each(), closed)

    def run_jobs(self) -> int:
        """Complete every queued job (fail it when its model raises). Returns how many ran."""
        store, n = self._store(), 0
        while (job := store.claim_next()) is not None:
            n += 1
            try:
                store.complete(job.id, run_fake_model(self.contract(job.model, job.version), job.inputs))
            except Exception as err:
                store.fail(job.id, str(err))
        return n

    def job(self, job_id: str) -> JobStatus:
        if self.jobs is None:
            raise JobNotFound.unknown(job_id)
        return self.jobs.get(job_id)

    def repository_index(self) -> list[RepositoryEntry]:
        return [RepositoryEntry(c.name, c.version, "UNAVAILABLE" if c.name in self.unloaded else "READY",
                                "unloaded" if c.name in self.unloaded else "", c.tenant) for c in self.models]

    async def load_model(self, name: str) -> None:
        self.contract(name)
        self.unloaded.discard(name)

    async def unload_model(self, name: str) -> None:
        self.contract(name)
        self.unloaded.add(name)

    async def node_status(self) -> dict[str, Any]:
        return {"zygotes": [{"runtime": "python", "rss_bytes": 50 << 20, "pss_bytes": 40 << 20}], "jobs": []}

    def status(self) -> list[ModelStatus]:
        out = []
        for c in self.models:
            state = "unloaded" if c.name in self.unloaded else "ready"
            instances: list[dict[str, Any]] = [] if c.name in self.unloaded else [
                {"id": "fake-0", "state": "idle", "rung": Rung.HOT.value}]
            out.append(ModelStatus(c.name, c.version, state, template=None, instances=instances))
        return out

    def _store(self) -> JobStore:
        if self.jobs is None:
            raise ModelNotReady("no capacity and no job store to queue the request in")
        return self.jobs
