"""The `llm` runtime's request and reply convention, and the text side of generation (no torch here).

`parse_request` turns the `request` input's JSON into a `Request` (InvalidInput naming the field; the fields are
in docs/llm-convention.md); `StopText` cuts the text before a stop string; `reply` is one reply's output
tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from ember.errors import InvalidInput
from ember.wire.chat import MAX_LOGIT_BIAS as MAX_BIASES
from ember.wire.chat import MAX_STOP_CHARS, MAX_STOPS, MAX_TOP_LOGPROBS
from ember.wire.json_text import lone_surrogate, may_hold_surrogate, surrogate_message

ROLES = ("system", "user", "assistant", "tool")
FIELDS = ("messages", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "logit_bias", "logprobs",
          "top_logprobs", "echo", "tools", "tool_choice", "response_format")
MESSAGE_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "name")


@dataclass(frozen=True)
class Message:
    """One chat message as the chat template sees it (docs/llm-convention.md)."""

    role: str
    content: str | None
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content if self.content is not None else ""}
        if self.tool_calls:   # templates read arguments as an object (HF's convention); OpenAI sends a string
            out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"])}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass(frozen=True)
class Request:
    """A parsed request (fields: docs/llm-convention.md); `field` names where the prompt came from."""

    messages: tuple[Message, ...] | None = None
    prompt: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str | dict[str, Any] = "auto"
    response_format: dict[str, Any] | None = None

    @property
    def field(self) -> str:
        return "prompt" if self.messages is None else "messages"

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def parse_request(raw: bytes, max_tokens: int | None = None) -> Request:
    """One request's JSON -> Request; InvalidInput whose message starts with the offending field. `max_tokens`
    caps the request's own (the contract's `limits.max_tokens`). `null` for an optional field is its default."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise InvalidInput(f"request: not valid UTF-8 ({err.reason} at byte {err.start})") from None
    except (json.JSONDecodeError, RecursionError) as err:
        raise InvalidInput(f"request: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"request: must be a JSON object, got {type(data).__name__}")
    if may_hold_surrogate(raw) and (bad := lone_surrogate(data)) is not None:   # a `\\ud800` escape: not text
        raise InvalidInput(surrogate_message(bad))
    for key in data:
        if key not in FIELDS:
            raise InvalidInput(f"{key}: unknown field (known: {', '.join(FIELDS)})")
    data = {k: v for k, v in data.items() if v is not None}
    if ("messages" in data) == ("prompt" in data):
        raise InvalidInput("messages: give either messages or prompt" + (", not both" if "prompt" in data else ""))
    fields: dict[str, Any] = {}
    if "messages" in data:
        fields["messages"] = _messages(data["messages"])
    elif not isinstance(data["prompt"], str):
        raise InvalidInput("prompt: must be a string")
    else:
        fields["prompt"] = data["prompt"]
    fields.update(_sampling(data, max_tokens))
    fields.update(_extras(data))
    request = Request(**fields)
    if request.echo and request.messages is not None:
        raise InvalidInput("echo: only with a prompt (the completions API)")
    return request


def checked_prompt(ids: list[int], request: Request, context: int) -> list[int]:
    """A prompt's tokens, if they fit a context of `context` tokens with room for one new token; else InvalidInput
    naming the request's field. The one rule every engine's runtime applies."""
    if not ids:
        raise InvalidInput(f"{request.field}: the prompt is empty (no tokens)")
    if len(ids) >= context:
        raise InvalidInput(f"{request.field}: prompt of {len(ids)} tokens exceeds the context of {context} "
                           "(it must leave room for at least one new token)")
    return ids


def token_budget(request: Request, prompt_tokens: int, context: int, default_max_tokens: int) -> int:
    """How many tokens the request may make: its `max_tokens` if the context has room for them (else
    InvalidInput), or without one the room left, at most `default_max_tokens`."""
    room = context - prompt_tokens
    if request.max_tokens is None:
        return min(room, default_max_tokens)
    if request.max_tokens > room:
        raise InvalidInput(f"max_tokens: {request.max_tokens} exceeds the context of {context} tokens "
                           f"less the prompt's {prompt_tokens} (at most {room})")
    return request.max_tokens


def _sampling(data: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if "max_tokens" in data:
        fields["max_tokens"] = _integer(data["max_tokens"], "max_tokens")
        if fields["max_tokens"] < 1:
            raise InvalidInput("max_tokens: must be at least 1")
        if max_tokens is not None and fields["max_tokens"] > max_tokens:
            raise InvalidInput(f"max_tokens: {fields['max_tokens']} exceeds the limit of {max_tokens} "
                               "(the contract's limits.max_tokens)")
    if "temperature" in data:
        fields["temperature"] = _number(data["temperature"], "temperature", 0.0, 2.0, "a number from 0 to 2")
    if "top_p" in data:
        fields["top_p"] = _number(data["top_p"], "top_p", 0.0, 1.0, "a number greater than 0 and at most 1")
        if fields["top_p"] <= 0:
            raise InvalidInput("top_p: must be a number greater than 0 and at most 1")
    if "seed" in data:
        fields["seed"] = _integer(data["seed"], "seed") % 2**64   # any integer: the generator takes 64 bits
    if "stop" in data:
        fields["stop"] = _stops(data["stop"])
    if "logit_bias" in data:
        fields["logit_bias"] = _biases(data["logit_bias"])
    return fields


def _extras(data: dict[str, Any]) -> dict[str, Any]:
    """logprobs, echo, tools and structured output."""
    fields: dict[str, Any] = {}
    for key in ("logprobs", "echo"):
        if key in data:
            if not isinstance(data[key], bool):
                raise InvalidInput(f"{key}: must be true or false")
            fields[key] = data[key]
    if "top_logprobs" in data:
        fields["top_logprobs"] = _integer(data["top_logprobs"], "top_logprobs")
        if not 0 <= fields["top_logprobs"] <= MAX_TOP_LOGPROBS:
            raise InvalidInput(f"top_logprobs: must be 0 to {MAX_TOP_LOGPROBS}")
        if fields["top_logprobs"] and not fields.get("logprobs"):
            raise InvalidInput("top_logprobs: needs logprobs: true")
    if "tools" in data:
        fields["tools"] = _tools(data["tools"])
    if "tool_choice" in data:
        fields["tool_choice"] = _tool_choice(data["tool_choice"], fields.get("tools", ()))
    if "response_format" in data:
        fields["response_format"] = _response_format(data["response_format"])
    return fields


def _messages(value: object) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise InvalidInput("messages: must be a non-empty list of {role, content} objects")
    return tuple(_message(i, m) for i, m in enumerate(value))


def _message(i: int, message: object) -> Message:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise InvalidInput(f"{where}: must be an object with role and content")
    for key in message:
        if key not in MESSAGE_FIELDS:
            raise InvalidInput(f"{where}.{key}: unknown field (known: {', '.join(MESSAGE_FIELDS)})")
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise InvalidInput(f"{where}.role: must be one of {', '.join(ROLES)}")
    calls = message.get("tool_calls") or []
    if content is None and not (role == "assistant"):
        raise InvalidInput(f"{where}.content: must be a string")
    if content is not None and not isinstance(content, str):
        raise InvalidInput(f"{where}.content: must be a string" + (" or null" if role == "assistant" else ""))
    if calls and role != "assistant":
        raise InvalidInput(f"{where}.tool_calls: only an assistant message calls tools")
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None and not isinstance(message[key], str):
            raise InvalidInput(f"{where}.{key}: must be a string")
    return Message(role, content, _calls(calls, f"{where}.tool_calls"), message.get("tool_call_id"),
                   message.get("name"))


def _calls(value: object, where: str) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list):
        raise InvalidInput(f"{where}: must be a list")
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments", "{}"), str | dict):
            raise InvalidInput(f"{where}[{j}]: must be {{id, type: function, function: {{name, arguments}}}}")
        out.append({"id": str(call.get("id") or f"call_{j}"), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", "{}")}})
    return tuple(out)


def _arguments(fn: dict[str, Any]) -> Any:
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _tools(value: object) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list):
        raise InvalidInput("tools: must be a list of {type: function, function: {name, parameters}}")
    out = []
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidInput(f"tools[{i}]: must be {{type: function, function: {{name, parameters}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidInput(f"tools[{i}].function.name: must be a non-empty string")
        if not isinstance(fn.get("parameters", {}), dict):
            raise InvalidInput(f"tools[{i}].function.parameters: must be a JSON schema object")
        out.append({"type": "function", "function": fn})
    return tuple(out)


def _tool_choice(value: object, tools: tuple[dict[str, Any], ...]) -> str | dict[str, Any]:
    if value in ("none", "auto", "required"):
        return str(value)
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidInput("tool_choice: must be none, auto, required or {type: function, function: {name}}")
    if fn["name"] not in {t["function"]["name"] for t in tools}:
        raise InvalidInput(f"tool_choice: names {fn['name']!r}, which is not among tools")
    return {"type": "function", "function": {"name": fn["name"]}}


def _response_format(value: object) -> dict[str, Any] | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = value.get("json_schema") if isinstance(value, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidInput("response_format.json_schema: must be {name, schema}")
        return {"type": "json_schema", "schema": spec.get("schema", {})}
    raise InvalidInput("response_format.type: must be text, json_object or json_schema")


def _biases(value: object) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, dict) or len(value) > MAX_BIASES:
        raise InvalidInput(f"logit_bias: must be an object of at most {MAX_BIASES} token ids and biases")
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidInput(f"logit_bias.{key}: keys must be token ids") from None
        if not 0 <= token < 2**31:   # llama_token is int32; a larger id overflowed the sampler
            raise InvalidInput(f"logit_bias.{key}: keys must be token ids")
        out.append((token, _number(bias, f"logit_bias.{key}", -100.0, 100.0, "a number from -100 to 100")))
    return tuple(out)


def _integer(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{name}: must be an integer")
    return value


def _number(value: object, name: str, low: float, high: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise InvalidInput(f"{name}: must be {what}")
    return float(value)


def _stops(value: object) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) for s in stops):
        raise InvalidInput(f"stop: must be a string or a list of at most {MAX_STOPS} strings")
    for i, stop in enumerate(stops):
        if not 0 < len(stop) <= MAX_STOP_CHARS:
            raise InvalidInput(f"stop[{i}]: must be 1 to {MAX_STOP_CHARS} characters")
    return tuple(stops)


class StopText:
    """Cuts generated text at the first stop string, holding back a tail that may begin one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops, self.pending = stops, ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was found: then the text ends just before it)."""
        buf = self.pending + text
        # The stop string whose first occurrence ends first (then the longer) wins: the one the character
        # stream completes first, whatever the tokens' boundaries.
        hits = [(i + len(s), i) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self.pending = ""
            return buf[: min(hits)[1]], True
        hold = max((k for s in self.stops for k in range(1, min(len(s), len(buf) + 1)) if buf.endswith(s[:k])),
                   default=0)
        self.pending = buf[len(buf) - hold:]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def reply(text: str, finish: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          logprobs: list[dict[str, Any]] | None = None,
          tool_calls: list[dict[str, Any]] | None = None) -> dict[str, np.ndarray]:
    """One reply's output tensors (docs/llm-convention.md); the caller keeps those its contract declares."""
    out = {"text": np.empty(1, dtype=object), "finish_reason": np.empty(1, dtype=object),
           "prompt_tokens": np.array([prompt_tokens], dtype=np.int64),
           "completion_tokens": np.array([completion_tokens], dtype=np.int64),
           "cached_tokens": np.array([cached_tokens], dtype=np.int64),
           "logprobs": np.empty(1, dtype=object), "tool_calls": np.empty(1, dtype=object)}
    out["text"][0], out["finish_reason"][0] = text.encode("utf-8"), finish.encode()
    out["logprobs"][0] = json.dumps(logprobs).encode() if logprobs is not None else b""
    out["tool_calls"][0] = json.dumps(tool_calls).encode() if tool_calls else b""
    return out
