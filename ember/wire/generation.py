"""The generation request of the `llm` convention (docs/llm-convention.md), its rules stated once.

One JSON object per generation: `messages` or `prompt`, and the sampling fields. `parse_request` turns it into a
`Request` (InvalidInput naming the field); every runtime of the convention parses its `request` input with it,
and the gateway runs it on a `request` tensor that will wait as a job (`ember.gateway.prompt_check`). The rules of
the sampling fields (`temperature`, `top_p`, `max_tokens`, `seed`, `stop`, `logit_bias`, `top_logprobs`,
`tool_choice`) are the functions below, each raising ValueError with a message relative to its field; the OpenAI
and V2 generate wire models (`ember.wire.chat`) check their fields with the same functions, so a field is refused
with one message whichever way it came.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, TypeVar

from ember.errors import InvalidInput
from ember.wire.json_text import lone_surrogate, may_hold_surrogate, surrogate_message

T = TypeVar("T")
RUNTIMES = frozenset({"llm", "vllm"})   # the runtimes of the convention
ROLES = ("system", "user", "assistant", "tool")
FIELDS = ("messages", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "logit_bias", "logprobs",
          "top_logprobs", "echo", "tools", "tool_choice", "response_format")
MESSAGE_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "name")
MAX_LOGIT_BIAS = 300
MAX_STOPS, MAX_STOP_CHARS = 4, 256
MAX_TOP_LOGPROBS = 20
TEMPERATURE = (0.0, 2.0)      # from, to (both allowed)
TOP_P = (0.0, 1.0)            # above, to
BIAS = (-100.0, 100.0)        # a logit bias: from, to
_TOKEN_ID = re.compile(r"^[0-9]{1,10}$")


# ------------------------------------------------------------------------------------------------ the rules


def named(field: str, text: str) -> str:
    """A rule's message under its field: `field: text`, or `field[1]: ...` / `field.key: ...` for a part of it."""
    return f"{field}{text}" if text[:1] in "[." else f"{field}: {text}"


def checked(field: str, rule: Callable[[Any], T], value: Any) -> T:
    """`rule(value)`; its ValueError as InvalidInput naming `field`."""
    try:
        return rule(value)
    except ValueError as err:
        raise InvalidInput(named(field, str(err))) from None


def integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("must be an integer")
    return value


def _number(value: Any, low: float, high: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ValueError(f"must be {what}")
    return float(value)


def max_tokens(value: Any, least: int = 1) -> int:
    tokens = integer(value)
    if tokens < least:
        raise ValueError(f"must be at least {least}")
    return tokens


def within_limit(tokens: int | None, limit: int | None) -> None:
    """InvalidInput if a request's `max_tokens` exceeds the contract's `limits.max_tokens`."""
    if tokens is not None and limit is not None and tokens > limit:
        raise InvalidInput(f"max_tokens: {tokens} exceeds the limit of {limit} (the contract's limits.max_tokens)")


def temperature(value: Any) -> float:
    return _number(value, *TEMPERATURE, f"a number from {TEMPERATURE[0]:g} to {TEMPERATURE[1]:g}")


def top_p(value: Any) -> float:
    what = f"a number greater than {TOP_P[0]:g} and at most {TOP_P[1]:g}"
    if _number(value, *TOP_P, what) <= TOP_P[0]:
        raise ValueError(f"must be {what}")
    return float(value)


def seed(value: Any) -> int:
    """Any integer: the generator takes it mod 2**64."""
    return integer(value) % 2**64


def stops(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOPS or not all(isinstance(s, str) for s in items):
        raise ValueError(f"must be a string or a list of at most {MAX_STOPS} strings")
    for i, stop in enumerate(items):
        if not 0 < len(stop) <= MAX_STOP_CHARS:
            raise ValueError(f"[{i}]: must be 1 to {MAX_STOP_CHARS} characters")
    return tuple(items)


def logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """`{"<token id>": bias}`: ids as strings of digits below 2**31 (llama_token is int32), biases -100 to 100."""
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"must be an object of at most {MAX_LOGIT_BIAS} token ids and biases")
    out = []
    for key, bias in value.items():
        if not isinstance(key, str) or not _TOKEN_ID.match(key) or int(key) >= 2**31:
            raise ValueError(f".{key}: keys must be token ids")
        try:
            out.append((int(key), _number(bias, *BIAS, f"a number from {BIAS[0]:g} to {BIAS[1]:g}")))
        except ValueError as err:
            raise ValueError(f".{key}: {err}") from None
    return tuple(out)


def top_logprobs(value: Any) -> int:
    n = integer(value)
    if not 0 <= n <= MAX_TOP_LOGPROBS:
        raise ValueError(f"must be 0 to {MAX_TOP_LOGPROBS}")
    return n


def tool_choice(value: Any) -> str | dict[str, Any]:
    """`none`, `auto`, `required`, or `{"type": "function", "function": {"name": ...}}`."""
    if value in ("none", "auto", "required"):
        return str(value)
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type", "function") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError("must be none, auto, required or {type: function, function: {name}}")
    return {"type": "function", "function": {"name": fn["name"]}}


def choice_among(choice: str | dict[str, Any], tools: Collection[str]) -> None:
    """A tool choice that calls tools needs them: `required` some, a named function one of that name."""
    if choice == "required" and not tools:
        raise ValueError("'required' needs tools")
    if isinstance(choice, dict) and choice["function"]["name"] not in tools:
        raise ValueError(f"names {choice['function']['name']!r}, which is not among tools")


# ----------------------------------------------------------------------------------------- the request


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


_SAMPLING: dict[str, Callable[[Any], Any]] = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                                              "seed": seed, "stop": stops, "logit_bias": logit_bias}


def _sampling(data: dict[str, Any], limit: int | None) -> dict[str, Any]:
    fields = {key: checked(key, rule, data[key]) for key, rule in _SAMPLING.items() if key in data}
    within_limit(fields.get("max_tokens"), limit)
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
        fields["top_logprobs"] = checked("top_logprobs", top_logprobs, data["top_logprobs"])
        if fields["top_logprobs"] and not fields.get("logprobs"):
            raise InvalidInput("top_logprobs: needs logprobs: true")
    if "tools" in data:
        fields["tools"] = _tools(data["tools"])
    if "tool_choice" in data:
        choice = fields["tool_choice"] = checked("tool_choice", tool_choice, data["tool_choice"])
        names = [t["function"]["name"] for t in fields.get("tools", ())]
        checked("tool_choice", lambda c: choice_among(c, names), choice)
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
