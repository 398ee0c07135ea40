"""The engine seam of the `llm` runtime: what ember needs of an LLM engine, and nothing more.

ember keeps the ladder (template and zygote forks, pause), the prefix cache and its snapshots, admission by
tokens and the streams; an engine does the math. The seam, after vLLM's v1 split between the scheduler's plan
and the step that executes it: a loaded model (`EngineModel`: mapped weights, the tokenizer, the chat
template) opens a `Context` (the KV memory for a number of sequences), and each scheduler step hands the
context one batch of `Feed`s (some tokens of some sequences at their positions) and gets each feed's logits
back. A sequence's KV can be cut, saved as bytes and restored (the prefix cache and snapshots).

The engine behind it is llama.cpp (ember.runtimes.llamacpp). Fork rules: loading the model starts no thread;
a context computes on the threads it is told (`set_threads`), and one thread starts no pool, so a template may
open a context and warm it up on one thread and still fork; an instance raises its threads after the fork.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ember.runtimes.llm_sampling import Mask

ECHO_OUTPUTS = 64   # logits rows one sequence may ask for in one step (a prompt's own log-probabilities)


@dataclass(frozen=True)
class Feed:
    """Tokens of one sequence for one step: `tokens` at positions `start`, `start + 1`, ...; `outputs`: for how
    many of the last of them the logits are wanted (1 at the end of a prompt or in a decode step, 0 mid-prompt,
    all of them for a prompt's own log-probabilities)."""

    seq: int
    tokens: tuple[int, ...]
    start: int
    outputs: int


class Context(Protocol):
    """KV memory for up to `slots` sequences (ids 0..slots-1) sharing `kv_tokens` cells (a pool that may `grow`)."""

    slots: int
    kv_tokens: int
    can_cut: bool          # whether a sequence cut back to a prefix carries on exactly (not with sliding windows)

    def set_threads(self, threads: int) -> None:
        """Threads for decoding and for prompt batches (after a fork: the template computes on one)."""

    def run(self, feeds: list[Feed]) -> list[np.ndarray | None]:
        """One forward pass over every feed; per feed the logits it asked for [outputs, vocab] (float32), or
        None."""

    def cut(self, seq: int, start: int = 0) -> bool:
        """Forget the sequence's positions from `start` on (0: all of it, the cells go back to the pool); False
        when the engine cannot cut there."""

    def state_bytes(self, seq: int) -> int:
        """The bytes `save` would take now."""

    def save(self, seq: int) -> bytes:
        """The sequence's KV as the engine's own bytes (exact: restoring it gives what recomputing gave)."""

    def restore(self, seq: int, data: bytes) -> int:
        """Load `save`d bytes into an empty sequence; the number of positions restored (0: it did not fit)."""

    def grow(self, kv_tokens: int, live: list[int]) -> None:
        """A pool of `kv_tokens` cells in place of this one, the `live` sequences' KV carried over exactly (their
        positions as they were); ModelNotReady when the engine cannot make it (the old pool stays)."""

    def close(self) -> None: ...


class EngineModel(Protocol):
    """A loaded model: weights mapped (shared by forked processes), vocabulary and chat template read."""

    name: str              # the engine's name, for logs and metrics ("llama.cpp")
    architecture: str      # from the file ("llama", "qwen2", "gemma2", ...)
    context_length: int    # the longest sequence the model was trained for
    vocab_size: int
    eos: frozenset[int]    # end-of-generation tokens
    bos: int | None
    add_bos: bool          # whether a raw prompt starts with BOS
    chat_template: str | None
    kv_bytes_per_token: int

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        """Token ids of `text`; `special`: control-token text (`<|im_start|>`) becomes the control token."""

    def piece(self, token: int) -> bytes:
        """The bytes a token stands for (empty for control tokens)."""

    def token_text(self, token: int) -> str:
        """The vocabulary's own text of a token (control tokens included)."""

    def grammar(self, gbnf: str) -> Mask:
        """A token mask that keeps the output within a GBNF grammar (structured output, forced tool calls)."""

    def open(self, slots: int, kv_tokens: int, *, threads: int = 1, kv_type: str = "f16",
             step_tokens: int = 512) -> Context:
        """KV memory for `slots` sequences sharing `kv_tokens` cells (allocated now), stepped with batches of at
        most `step_tokens` tokens."""

    def close(self) -> None: ...
