"""From picked tokens to what a reply carries: whole UTF-8 text, stop strings cut, tool calls, log-probabilities.

`Output.push` takes each picked token and returns the reply's `Piece` (docs/llm-convention.md). Text comes from
the engine's token bytes through an incremental UTF-8 decoder, so a character split across tokens comes out
whole in a later reply. With tools, text that may be the start of a tool call is held back until it cannot be
(then it is sent as text) or the generation ends (then it is parsed into calls: `finish_reason` `tool_calls`).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ember.runtimes.llm_request import StopText
from ember.runtimes.llm_sampling import log_softmax, top_of
from ember.runtimes.llm_tools import ToolCalls

if TYPE_CHECKING:
    from ember.runtimes.llm_sampling import Choice
    from ember.runtimes.llm_tools import ToolFormat


@dataclass(frozen=True)
class Piece:
    text: str
    finish: str
    logprobs: list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None


class Output:
    def __init__(self, piece: Callable[[int], bytes], eos: frozenset[int], stops: tuple[str, ...], *,
                 logprobs: bool = False, top_logprobs: int = 0, tools: ToolFormat | None = None, prefix: str = "",
                 tool_names: frozenset[str] | None = None, tags: dict[int, bytes] | None = None) -> None:
        """`tags`: control tokens that open a tool call in this format (Mistral's [TOOL_CALLS]), as their text:
        the engine gives control tokens no text. `top_logprobs`: the alternatives each echoed prompt token carries
        (a generated token's come from its sampler)."""
        self.eos, self.cut = eos, StopText(stops)
        self.piece = piece if not tags else (lambda t: tags.get(t) or piece(t))
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.logprobs, self.top_logprobs, self.calls = logprobs, top_logprobs, ToolCalls(tools, tool_names)
        self.prefix = prefix           # text that leads the first reply (echo)
        self.prompt_entries: list[dict[str, Any]] = []

    def push(self, choice: Choice, last: bool) -> Piece:
        entries = self._entries(choice) if self.logprobs else None
        if self.prompt_entries:
            entries, self.prompt_entries = [*self.prompt_entries, *(entries or [])], []
        if choice.token in self.eos:
            text, _ = self.cut.push(self.utf8.decode(b"", final=True))
            return self._finish(text + self.cut.flush(), "stop", entries)
        text, stopped = self.cut.push(self.utf8.decode(self.piece(choice.token)))
        if stopped:
            return self._finish(text, "stop", entries)
        if last:
            tail, stopped = self.cut.push(self.utf8.decode(b"", final=True))
            return self._finish(text + tail + ("" if stopped else self.cut.flush()), "stop" if stopped else "length",
                                entries)
        return Piece(self._lead(self.calls.push(text)), "", entries)

    def _finish(self, text: str, finish: str, entries: list[dict[str, Any]] | None) -> Piece:
        text, calls = self.calls.finish(text)
        if calls:
            return Piece(self._lead(""), "tool_calls", entries, calls)
        return Piece(self._lead(text), finish, entries)

    def _lead(self, text: str) -> str:
        if self.prefix:
            text, self.prefix = self.prefix + text, ""
        return text

    def _entries(self, choice: Choice) -> list[dict[str, Any]]:
        if choice.token in self.eos:
            return []
        return [self._entry(choice.token, choice.logprob or 0.0, choice.top)]

    def _entry(self, token: int, logprob: float, top: tuple[tuple[int, float], ...]) -> dict[str, Any]:
        raw = self.piece(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw),
                "top_logprobs": [{"token": self.piece(t).decode("utf-8", "replace"), "logprob": lp,
                                  "bytes": list(self.piece(t))} for t, lp in top]}

    def prompt_logits(self, ids: list[int], start: int, logits: np.ndarray) -> None:
        """Echo with logprobs: the log-probability of each prompt token after `start` and the `top_logprobs` most
        likely tokens in its place, from the logits of the token before it (the first prompt token has neither:
        its logprob is null, as OpenAI's and vLLM's are)."""
        if start == 0:
            self.prompt_entries.append({**self._entry(ids[0], 0.0, ()), "logprob": None})
        for row, token in enumerate(ids[start + 1: start + len(logits) + 1]):
            lp = log_softmax(logits[row])
            self.prompt_entries.append(self._entry(token, float(lp[token]), top_of(lp, self.top_logprobs)))
