"""Continuous batching: the sequences of one LLM instance, stepped together.

Iteration-level scheduling, as Orca and vLLM do it: every `step()` is one decode forward pass for every
running sequence (each at its own position, ember.runtimes.llm_batch) plus at most one prefill chunk of a new
one; a new request joins between two steps, a finished one leaves at once. Limits: `slots` sequences at once
(the contract's `scaling.max_concurrency`) and `max_tokens_in_flight` (prompt plus budget of every running
sequence); a request beyond them waits its turn. Sampling is per sequence (its own torch.Generator).

Callers hold one generator per request (`LLMModel.stream`): whichever asks first runs a step, which makes a
token for every running sequence; the others' tokens wait in their outboxes. So the instance server, which
takes one reply from each stream in turn, batches its streams without knowing it.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ember.errors import Cancelled
from ember.runtimes.llm_batch import KVSlots, LlamaWeights, decode, prefill
from ember.runtimes.llm_prefix import PrefixCache
from ember.runtimes.llm_request import IncrementalText, Request, StopText

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from ember.runtimes import StopCheck

PREFILL_CHUNK = 512   # prompt tokens per forward pass: bounds attention memory and the others' wait


@dataclass
class Token:
    """What a step made for one sequence: new text, the finish reason ("" until the last), and counts."""

    text: str
    finish: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(eq=False)
class Sequence:
    request: Request
    ids: list[int]
    limit: int
    stop: StopCheck | None
    text: IncrementalText
    cut: StopText
    generator: torch.Generator | None
    outbox: deque[Token | BaseException] = field(default_factory=deque)
    slot: int = -1
    fed: int = 0          # prompt tokens in the KV
    cached: int = 0       # of which came from the prefix cache
    count: int = 0        # tokens generated
    pending: int | None = None   # the last token generated, to feed next step
    generated: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def tokens_in_flight(self) -> int:
        return len(self.ids) + self.limit

    def emit(self, token: int, eos: frozenset[int]) -> None:
        """Turn a generated token into the sequence's next Token (the text side of ember.runtimes.llm)."""
        self.count += 1
        self.generated.append(token)
        if token in eos:
            self._put(self.cut.push(self.text.flush())[0] + self.cut.flush(), "stop")
            return
        piece, stopped = self.cut.push(self.text.push(token))
        if not stopped and self.count >= self.limit:
            tail, stopped = self.cut.push(self.text.flush())
            piece += tail if stopped else tail + self.cut.flush()
            self._put(piece, "stop" if stopped else "length")
            return
        self._put(piece, "stop" if stopped else "")
        self.pending = None if stopped else token

    def _put(self, text: str, finish: str) -> None:
        self.outbox.append(Token(text, finish, len(self.ids), self.count, self.cached))
        self.done = bool(finish)
        self.pending = None


class Decoder:
    """Running and waiting sequences over one set of KV slots; `step()` advances all of them."""

    def __init__(self, weights: LlamaWeights, eos: frozenset[int], slots: int, max_tokens_in_flight: int,
                 cache: PrefixCache, pick: Callable[[torch.Tensor, Sequence], int],
                 decode_text: Callable[[list[int]], str]) -> None:
        self.w, self.eos, self.cache, self.pick, self.decode_text = weights, eos, cache, pick, decode_text
        self.kv = KVSlots(weights, slots)
        self.max_tokens_in_flight = max_tokens_in_flight
        self.running: list[Sequence] = []     # slot i holds running[i]
        self.waiting: deque[Sequence] = deque()
        self.decode_steps = 0                 # for tests and benchmarks: decode passes, and the most rows in one
        self.widest_step = 0

    def add(self, request: Request, ids: list[int], limit: int, stop: StopCheck | None) -> Sequence:
        import torch

        generator = None
        if request.temperature > 0:
            seed = request.seed if request.seed is not None else int.from_bytes(os.urandom(8), "little")
            generator = torch.Generator().manual_seed(seed % 2**64)
        seq = Sequence(request, ids, limit, stop, IncrementalText(self.decode_text), StopText(request.stop),
                       generator)
        self.waiting.append(seq)
        return seq

    def drop(self, seq: Sequence) -> None:
        """Forget `seq` (finished, cancelled or its reader gone); its slot goes to the last running one."""
        seq.done = True
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot < 0:
            return
        last = len(self.running) - 1
        if seq.slot != last:
            mover = self.running[last]
            self.kv.move(last, seq.slot)
            mover.slot = seq.slot
            self.running[seq.slot] = mover
        self.running.pop()
        self.kv.lengths[last] = 0
        seq.slot = -1

    def step(self) -> None:
        """One iteration: stop checks, admissions, one prefill chunk, one decode pass for all prefilled."""
        for seq in [*self.running, *self.waiting]:
            if seq.stop is not None and seq.stop():
                seq.outbox.append(Cancelled(f"stopped after {seq.count} tokens"))
                self.drop(seq)
        self._admit()
        # The sequences decoding already: every running one but the one mid-prefill (in the last slot). One
        # whose prompt completes in this step decodes from the next, so its first token goes out now, not one
        # forward pass later (that pass was half of a hot time to first token).
        ready = [s for s in self.running if s.pending is not None]
        self._prefill_one()
        if ready:
            self._decode(ready)

    def _admit(self) -> None:
        """Waiting sequences take free slots while tokens in flight allow (one at a time is always allowed);
        only one sequence prefills at once, in the slot after the decoding ones."""
        while self.waiting and len(self.running) < self.kv.slots and self._prefilling() is None:
            seq = self.waiting[0]
            busy = sum(s.tokens_in_flight for s in self.running)
            if self.running and busy + seq.tokens_in_flight > self.max_tokens_in_flight:
                return
            self.waiting.popleft()
            seq.slot = len(self.running)
            self.running.append(seq)
            n, kv = self.cache.lookup(seq.ids)
            self.kv.lengths[seq.slot] = 0
            if kv is not None:
                self.kv.restore(seq.slot, kv)
            seq.fed = seq.cached = n

    def _prefilling(self) -> Sequence | None:
        return next((s for s in self.running if s.fed < len(s.ids)), None)

    def _prefill_one(self) -> None:
        seq = self._prefilling()
        if seq is None:
            return
        chunk = seq.ids[seq.fed: seq.fed + PREFILL_CHUNK]
        logits = prefill(self.w, self.kv, seq.slot, chunk)
        seq.fed += len(chunk)
        if seq.fed < len(seq.ids):
            return
        if not self.cache.covers(seq.ids):
            self.cache.insert(seq.ids, self.kv.export(seq.slot, len(seq.ids)))
        self._emit(seq, self.pick(logits, seq))

    def _decode(self, seqs: list[Sequence]) -> None:
        assert [s.slot for s in seqs] == list(range(len(seqs))), "decoding slots must be 0..n-1"
        logits = decode(self.w, self.kv, [s.pending for s in seqs if s.pending is not None])
        self.decode_steps += 1
        self.widest_step = max(self.widest_step, len(seqs))
        for i, seq in enumerate(seqs):
            self._emit(seq, self.pick(logits[i], seq))

    def _emit(self, seq: Sequence, token: int) -> None:
        seq.emit(token, self.eos)
        if seq.done:
            self.drop(seq)
