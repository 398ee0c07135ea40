"""What every runtime of the `llm` convention shares besides the request's rules (`ember.wire.generation`): the
`request` input read and parsed (`request_of`), the contract's tensors checked against the convention
(`check_convention`), a prompt's length and token budget against the context, `logit_bias` ids against the
vocabulary, `StopText` cutting the text before a stop string, and `reply`, one reply's output tensors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from ember.errors import ContractInvalid, InvalidInput
from ember.wire.contract import ModelContract
from ember.wire.generation import Request, parse_request

# The convention's tensors: name -> (datatype, input or output); each of shape [1].
CONVENTION = {"request": ("BYTES", "input"), "text": ("BYTES", "output"), "finish_reason": ("BYTES", "output"),
              "prompt_tokens": ("INT64", "output"), "completion_tokens": ("INT64", "output"),
              "cached_tokens": ("INT64", "output"), "logprobs": ("BYTES", "output"), "tool_calls": ("BYTES", "output")}
OPTIONAL = frozenset({"cached_tokens", "logprobs", "tool_calls"})


def request_of(inputs: Mapping[str, np.ndarray], contract: ModelContract) -> Request:
    """The `request` input of one generation, parsed within the contract's `limits.max_tokens`."""
    if "request" not in inputs:
        raise InvalidInput(f"input 'request': missing (model '{contract.name}' requires it)")
    items = np.asarray(inputs["request"], dtype=object).reshape(-1)
    if len(items) != 1 or not isinstance(items[0], bytes | str | np.bytes_):
        raise InvalidInput("request: expected one UTF-8 JSON object")
    raw = items[0].encode() if isinstance(items[0], str) else bytes(items[0])
    return parse_request(raw, contract.limits.max_tokens)


def check_biases(request: Request, vocab_size: int) -> None:
    """`logit_bias` names token ids of the model's vocabulary only."""
    for token, _ in request.logit_bias:
        if token >= vocab_size:
            raise InvalidInput(f"logit_bias.{token}: not a token id of this model (its vocabulary has {vocab_size})")


def check_convention(contract: ModelContract, runtime: str) -> None:
    """The contract's tensors follow the convention (ContractInvalid naming the key), for the runtime named."""
    where = f"model '{contract.key}'"
    for kind, specs in (("input", contract.inputs), ("output", contract.outputs)):
        expected = [name for name, (_, k) in CONVENTION.items() if k == kind]
        names = [spec.name for spec in specs]
        if sorted(set(names) | (OPTIONAL & set(expected))) != sorted(expected) or len(set(names)) != len(names):
            required = [n for n in expected if n not in OPTIONAL]
            optional = [n for n in expected if n in OPTIONAL]
            raise ContractInvalid(f"{where}: {kind}s: the {runtime} runtime takes {kind}s {', '.join(required)}"
                                  + (f" (and optionally {', '.join(optional)})" if optional else "")
                                  + f", not {', '.join(names)}")
        for spec in specs:
            datatype = CONVENTION[spec.name][0]
            if spec.datatype != datatype or spec.shape != (1,):
                raise ContractInvalid(f"{where}: {kind}s.{spec.name}: expected {datatype} [1], "
                                      f"got {spec.datatype} {list(spec.shape)}")


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
