"""How an LLM instance's replies become OpenAI bodies: a whole `chat.completion` / `text_completion`, or its SSE
chunks (a `StreamShape`), for one choice or several.

A reply follows the `llm` runtime's convention (`docs/llm-convention.md`): `text`, `finish_reason`,
`prompt_tokens`, `completion_tokens`, and optionally `cached_tokens`, `logprobs` (OpenAI's chat entries as JSON)
and `tool_calls` (on the last reply, as JSON). Chat answers carry `logprobs: {"content": [...]}` and
`message.tool_calls` (content null, finish reason `tool_calls`); streamed, each call is one delta
`tool_calls: [{"index", "id", "type", "function": {"name", "arguments"}}]`. Completions carry the legacy
`logprobs: {tokens, token_logprobs, top_logprobs, text_offset}`. With several choices (`n`, or several prompts)
the chunks of each carry its `index`, and `usage` counts each prompt once and every completion.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ember.errors import EmberError, ModelFailed
from ember.gateway.errors import openai_error_body
from ember.gateway.sse import sse
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

_OUTPUTS = {"text": "BYTES", "finish_reason": "BYTES", "prompt_tokens": "INT64", "completion_tokens": "INT64"}


@dataclass
class Reply:
    """One reply of an instance, or all of a request's replies collected into one."""

    text: str
    finish: str
    usage: dict[str, Any]
    logprobs: list[dict[str, Any]] | None = None     # None: the model sent no `logprobs` output
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def _json_items(outputs: Tensors, name: str) -> list[list[Any]]:
    """Each non-empty element of a BYTES output, parsed as a JSON list."""
    items = []
    for raw in outputs[name].reshape(-1):
        if bytes(raw):
            value = json.loads(bytes(raw))
            if not isinstance(value, list):
                raise TypeError(f"output '{name}' is not a JSON list")
            items.append(value)
    return items


def _entry(e: Any) -> dict[str, Any]:
    if not isinstance(e, dict) or not isinstance(e.get("token"), str) or \
            not isinstance(e.get("logprob"), int | float | None) or not isinstance(e.get("top_logprobs", []), list):
        raise TypeError(f"a logprobs entry is not {{token, logprob, bytes, top_logprobs}}: {str(e)[:80]}")
    return e


def _call(c: Any) -> dict[str, Any]:
    function = c.get("function") if isinstance(c, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or \
            not isinstance(function.get("arguments"), str):
        raise TypeError(f"a tool call is not {{id, type, function: {{name, arguments}}}}: {str(c)[:80]}")
    return {"id": str(c.get("id") or "call_" + uuid.uuid4().hex[:24]), "type": "function",
            "function": {"name": function["name"], "arguments": function["arguments"]}}


def reply_of(outputs: Tensors) -> Reply:
    """One reply, or every reply collected into one answer (elements concatenated)."""
    try:
        text = b"".join(bytes(t) for t in outputs["text"].reshape(-1)).decode("utf-8", errors="replace")
        finishes = [bytes(f).decode() for f in outputs["finish_reason"].reshape(-1) if bytes(f)]
        prompt, completion = int(np.max(outputs["prompt_tokens"])), int(np.max(outputs["completion_tokens"]))
        logprobs = [_entry(e) for item in _json_items(outputs, "logprobs") for e in item] \
            if "logprobs" in outputs else None
        calls = _json_items(outputs, "tool_calls")[-1:] if "tool_calls" in outputs else []
        tool_calls = [_call(c) for item in calls for c in item]
    except (KeyError, ValueError, TypeError) as err:
        raise ModelFailed(f"the model's reply does not follow the text-generation convention: {err}") from None
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
    if "cached_tokens" in outputs:   # OpenAI's name for prompt tokens served from the prefix cache
        usage["prompt_tokens_details"] = {"cached_tokens": int(np.max(outputs["cached_tokens"]))}
    finish = "tool_calls" if tool_calls else (finishes[-1] if finishes else "")
    return Reply(text, finish, usage, logprobs, tool_calls)


def generates_text(contract: ModelContract) -> bool:
    """Whether the model follows the text-generation convention: one input `request` BYTES and the outputs above
    (`ember.gateway.chat_api`)."""
    spec = contract.input("request")
    outputs = {o.name: o.datatype for o in contract.outputs}
    return len(contract.inputs) == 1 and spec is not None and spec.datatype == "BYTES" and \
        all(outputs.get(k) == v for k, v in _OUTPUTS.items())


def one_row(outputs: Tensors) -> Tensors:
    """A generation's replies collected (one row per reply) as the one row the convention declares ([1] each): the
    whole text, the last finish reason, the final counts, every log-probability entry in one list, the tool calls
    of the last reply that has them. Outputs the convention does not name are left as they are."""
    rows = {name: np.asarray(a).reshape(-1) for name, a in outputs.items()}
    if all(len(rows[n]) == 1 for n in _FOLDS if n in rows):
        return outputs
    out = dict(outputs)
    try:
        for name, fold in _FOLDS.items():
            if name in rows and len(rows[name]):
                out[name] = fold(rows[name])
    except (ValueError, TypeError) as err:
        raise ModelFailed(f"the model's replies do not follow the text-generation convention: {err}") from None
    return out


def _one(value: object) -> np.ndarray:
    arr = np.empty(1, dtype=object)
    arr[0] = value
    return arr


def _last_set(items: np.ndarray) -> np.ndarray:
    return _one(next((bytes(x) for x in reversed(items) if bytes(x)), b""))


def _entries(items: np.ndarray) -> np.ndarray:
    entries = [e for x in items if bytes(x) for e in json.loads(bytes(x))]
    return _one(json.dumps(entries).encode() if any(bytes(x) for x in items) else b"")


_FOLDS = {"text": lambda items: _one(b"".join(bytes(x) for x in items)), "finish_reason": _last_set,
          "prompt_tokens": lambda a: a.max(keepdims=True), "completion_tokens": lambda a: a.max(keepdims=True),
          "cached_tokens": lambda a: a.max(keepdims=True), "logprobs": _entries, "tool_calls": _last_set}


def total_usage(usages: list[dict[str, Any]], per_prompt: int) -> dict[str, Any]:
    """Usage of several choices: each prompt's tokens once (choices `p * n .. p * n + n - 1` share one), every
    choice's completion."""
    firsts = usages[::per_prompt]
    prompt = sum(u["prompt_tokens"] for u in firsts)
    completion = sum(u["completion_tokens"] for u in usages)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if any("prompt_tokens_details" in u for u in firsts):
        cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in firsts)
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


class _Shape:
    """What the chat and completions shapes share: the id, the choices' state while streaming, usage."""

    chunk_object, whole_object, prefix = "", "", ""

    def __init__(self, model: str, *, choices: int = 1, per_prompt: int = 1, include_usage: bool = False,
                 logprobs: bool = False) -> None:
        self.model, self.choices, self.per_prompt = model, choices, per_prompt
        self.include_usage, self.logprobs = include_usage, logprobs
        self.id = self.prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self._finish = [""] * choices
        self._usage: list[dict[str, Any]] = [{"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}] * choices

    def base(self, chunk: bool) -> dict[str, Any]:
        return {"id": self.id, "object": self.chunk_object if chunk else self.whole_object, "created": self.created,
                "model": self.model}

    def chunk(self, choice: dict[str, Any]) -> str:
        out = {**self.base(True), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return sse(out)

    def piece(self, outputs: Tensors, index: int = 0) -> list[str]:
        reply = reply_of(outputs)
        self._finish[index] = reply.finish or self._finish[index]
        self._usage[index] = reply.usage
        return self.pieces(reply, index)

    def pieces(self, reply: Reply, index: int) -> list[str]:
        raise NotImplementedError

    def last(self, index: int, finish: str) -> dict[str, Any]:
        raise NotImplementedError

    def opening(self) -> list[str]:
        return []

    def closing(self) -> list[str]:
        out = [self.chunk(self.last(i, self._finish[i] or "stop")) for i in range(self.choices)]
        if self.include_usage:
            out.append(sse({**self.base(True), "choices": [], "usage": total_usage(self._usage, self.per_prompt)}))
        return [*out, sse("[DONE]")]

    def error(self, err: EmberError) -> list[str]:
        return [sse(openai_error_body(err))]

    def whole(self, replies: list[Reply]) -> dict[str, Any]:
        choices = [self.choice(i, r) for i, r in enumerate(replies)]
        return {**self.base(False), "choices": choices,
                "usage": total_usage([r.usage for r in replies], self.per_prompt)}

    def choice(self, index: int, reply: Reply) -> dict[str, Any]:
        raise NotImplementedError


class ChatShape(_Shape):
    chunk_object, whole_object, prefix = "chat.completion.chunk", "chat.completion", "chatcmpl-"

    def _logprobs(self, reply: Reply) -> dict[str, Any] | None:
        if not self.logprobs or reply.logprobs is None:
            return None
        return {"content": reply.logprobs, "refusal": None}

    def choice(self, index: int, reply: Reply) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply.text}
        if reply.tool_calls:
            message["content"] = reply.text or None
            message["tool_calls"] = reply.tool_calls
        return {"index": index, "message": message, "logprobs": self._logprobs(reply),
                "finish_reason": reply.finish or "stop"}

    def opening(self) -> list[str]:
        return [self.chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}) for i in range(self.choices)]

    def pieces(self, reply: Reply, index: int) -> list[str]:
        out = []
        if reply.text or reply.logprobs:
            out.append(self.chunk({"index": index, "delta": {"content": reply.text}, "logprobs": self._logprobs(reply),
                                   "finish_reason": None}))
        for k, call in enumerate(reply.tool_calls):   # as OpenAI streams them: one delta per call, by its index
            out.append(self.chunk({"index": index, "delta": {"tool_calls": [{"index": k, **call}]}, "logprobs": None,
                                   "finish_reason": None}))
        return out

    def last(self, index: int, finish: str) -> dict[str, Any]:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}


class CompletionShape(_Shape):
    """`/v1/completions`: choice `p * n + i` is prompt `p`'s `i`-th; legacy logprobs with text offsets into the
    prompt and its completion (from 0 with echo, else from the prompt's length)."""

    chunk_object, whole_object, prefix = "text_completion", "text_completion", "cmpl-"

    def __init__(self, model: str, prompts: list[str], *, n: int = 1, echo: bool = False, prompt_only: bool = False,
                 include_usage: bool = False, logprobs: bool = False) -> None:
        super().__init__(model, choices=len(prompts) * n, per_prompt=n, include_usage=include_usage,
                         logprobs=logprobs)
        self.prompts, self.echo, self.prompt_only = [p for p in prompts for _ in range(n)], echo, prompt_only
        self._offset = [0 if echo else len(p) for p in self.prompts]

    def _legacy(self, index: int, reply: Reply) -> dict[str, Any] | None:
        if not self.logprobs or reply.logprobs is None:
            return None
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in reply.logprobs:
            out["tokens"].append(e["token"])
            out["token_logprobs"].append(e["logprob"])
            out["top_logprobs"].append(None if e["logprob"] is None else
                                       {t["token"]: t["logprob"] for t in e.get("top_logprobs") or []})
            out["text_offset"].append(self._offset[index])
            self._offset[index] += len(e["token"])
        return out

    def _prompt_alone(self, index: int, reply: Reply) -> Reply:
        """`max_tokens: 0` with echo: the one token asked for is dropped, the prompt's logprobs kept."""
        entries = reply.logprobs
        if entries is not None and reply.usage["completion_tokens"]:
            entries = entries[:max(0, len(entries) - reply.usage["completion_tokens"])]
        usage = {**reply.usage, "completion_tokens": 0, "total_tokens": reply.usage["prompt_tokens"]}
        return Reply(self.prompts[index], "length", usage, entries)

    def choice(self, index: int, reply: Reply) -> dict[str, Any]:
        if self.prompt_only:
            reply = self._prompt_alone(index, reply)
        return {"index": index, "text": reply.text, "logprobs": self._legacy(index, reply),
                "finish_reason": reply.finish or "stop"}

    def whole(self, replies: list[Reply]) -> dict[str, Any]:
        out = super().whole(replies)
        if self.prompt_only:
            out["usage"] = total_usage([self._prompt_alone(i, r).usage for i, r in enumerate(replies)],
                                       self.per_prompt)
        return out

    def pieces(self, reply: Reply, index: int) -> list[str]:
        if not reply.text and not reply.logprobs:
            return []
        return [self.chunk({"index": index, "text": reply.text, "logprobs": self._legacy(index, reply),
                            "finish_reason": None})]

    def last(self, index: int, finish: str) -> dict[str, Any]:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": finish}
