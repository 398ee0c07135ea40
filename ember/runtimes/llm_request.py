"""The `llm` runtime's request and reply convention, and the text side of generation (no torch here).

`parse_request` turns the `request` input's JSON into a `Request` (InvalidInput naming the field, see
ember.runtimes.llm for the fields); `IncrementalText` turns token ids into whole UTF-8 characters as they
complete; `StopText` cuts the text before a stop string; `reply` is one reply's output tensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ember.errors import InvalidInput

ROLES = ("system", "user", "assistant")
FIELDS = ("messages", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop")
MAX_STOPS, MAX_STOP_CHARS = 4, 256


@dataclass(frozen=True)
class Request:
    """A parsed request (fields: ember.runtimes.llm's docstring); `field` names where the prompt came from."""

    messages: tuple[tuple[str, str], ...] | None = None
    prompt: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def field(self) -> str:
        return "prompt" if self.messages is None else "messages"


def parse_request(raw: bytes, max_tokens: int | None = None) -> Request:
    """One request's JSON -> Request; InvalidInput whose message starts with the offending field. `max_tokens`
    caps the request's own (the contract's `limits.max_tokens`)."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise InvalidInput(f"request: not valid UTF-8 ({err.reason} at byte {err.start})") from None
    except (json.JSONDecodeError, RecursionError) as err:
        raise InvalidInput(f"request: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"request: must be a JSON object, got {type(data).__name__}")
    for key in data:
        if key not in FIELDS:
            raise InvalidInput(f"{key}: unknown field (known: {', '.join(FIELDS)})")
    if ("messages" in data) == ("prompt" in data):
        raise InvalidInput("messages: give either messages or prompt" + (", not both" if "prompt" in data else ""))
    fields: dict[str, Any] = {}
    if "messages" in data:
        fields["messages"] = _messages(data["messages"])
    elif not isinstance(data["prompt"], str):
        raise InvalidInput("prompt: must be a string")
    else:
        fields["prompt"] = data["prompt"]
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
    return Request(**fields)


def _messages(value: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise InvalidInput("messages: must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise InvalidInput(f"messages[{i}]: must be an object with role and content")
        for key in message:
            if key not in ("role", "content"):
                raise InvalidInput(f"messages[{i}].{key}: unknown field (known: role, content)")
        if message.get("role") not in ROLES:
            raise InvalidInput(f"messages[{i}].role: must be one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise InvalidInput(f"messages[{i}].content: must be a string")
        out.append((message["role"], message["content"]))
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


class IncrementalText:
    """Token ids -> text as it becomes whole: a token that ends inside a UTF-8 character is held back.

    Decodes a small window (the last emitted piece plus what is new) so that decoders which treat the first
    token specially (sentencepiece's leading space) still join pieces correctly; O(1) per token.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode, self.start, self.read = decode, 0, 0
        self.ids: list[int] = []

    def push(self, token: int) -> str:
        self.ids.append(token)
        done = self.decode(self.ids[self.start: self.read])
        text = self.decode(self.ids[self.start:])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self.start, self.read = self.read, len(self.ids)
            return text[len(done):]
        return ""

    def flush(self) -> str:
        done, text = self.decode(self.ids[self.start: self.read]), self.decode(self.ids[self.start:])
        self.start = self.read = len(self.ids)
        return text[len(done):]


def reply(text: str, finish: str, prompt_tokens: int, completion_tokens: int,
          cached_tokens: int = 0) -> dict[str, np.ndarray]:
    out = {"text": np.empty(1, dtype=object), "finish_reason": np.empty(1, dtype=object),
           "prompt_tokens": np.array([prompt_tokens], dtype=np.int64),
           "completion_tokens": np.array([completion_tokens], dtype=np.int64),
           "cached_tokens": np.array([cached_tokens], dtype=np.int64)}
    out["text"][0], out["finish_reason"][0] = text.encode("utf-8"), finish.encode()
    return out
