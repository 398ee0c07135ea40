"""Continuous batching over an engine context: the sequences of one LLM instance, stepped together.

Iteration-level scheduling, as Orca and vLLM do it. Each `step()` first plans (`plan_step`, a pure function of
the running sequences: vLLM v1's scheduler output), then runs the plan as one engine batch: one decode token
for every sequence that is generating, and prompt chunks of joining sequences in the room left of the step's
token budget (chunked prefill: a long prompt is fed over several steps while the others keep decoding, and the
shortest remaining prompt goes first, so a short one joining behind a long one is not held up by it).

Admission is by KV cells: a sequence reaches at most its prompt plus its token budget, and the sum of what the
running sequences reach never exceeds the context's pool, so a step never runs out of cells and one request
never takes another's stream down. A request that could not fit even alone was refused before it got here.
A new request joins between two steps, a finished one leaves at once and its cells go back to the pool.

Callers hold one generator per request (`LLMModel.stream`): whichever asks first runs a step, which makes a
token for every running sequence; the others' tokens wait in their outboxes. So the instance server, which
takes one reply from each stream in turn, batches its streams without knowing it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ember.errors import Cancelled, ModelNotReady
from ember.runtimes.llm_engine import ECHO_OUTPUTS, Feed

if TYPE_CHECKING:
    import numpy as np

    from ember.runtimes import StopCheck
    from ember.runtimes.llm_engine import Context
    from ember.runtimes.llm_output import Output
    from ember.runtimes.llm_prefix import PrefixCache, Scope
    from ember.runtimes.llm_sampling import Sampler


@dataclass
class Token:
    """What a step made for one sequence: new text, the finish reason ("" until the last), and counts."""

    text: str
    finish: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None


@dataclass(eq=False)
class Sequence:
    ids: list[int]            # the prompt's tokens
    limit: int                # tokens it may generate
    stop: StopCheck | None
    sampler: Sampler
    output: Output            # tokens -> Tokens (text, stop strings, tool calls, logprobs)
    echo_logprobs: bool = False   # logits for every prompt token (completions' echo with logprobs)
    scope: Scope = None       # whose prefix-cache entries it may use and makes (ember.runtimes.llm_prefix)
    outbox: deque[Token | BaseException] = field(default_factory=deque)
    slot: int = -1
    fed: int = 0              # prompt tokens in the KV
    cached: int = 0           # of which came from the prefix cache
    pos: int = 0              # the next position to write
    pending: int | None = None    # the last token generated, to feed next step
    generated: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def reach(self) -> int:
        """KV cells this sequence may come to hold."""
        return len(self.ids) + self.limit

    def take(self, logits: np.ndarray) -> None:
        """The token picked from `logits`: turned into the next Token; fed next step unless it ended. The
        end-of-sequence token is not counted among the completion's tokens (as llama.cpp's server and vLLM count)."""
        choice = self.sampler.pick(logits)
        self.generated.append(choice.token)
        out = self.output.push(choice, len(self.generated) >= self.limit)
        counted = len(self.generated) - (choice.token in self.output.eos)
        self.outbox.append(Token(out.text, out.finish, len(self.ids), counted, self.cached, out.logprobs,
                                 out.tool_calls))
        self.done = bool(out.finish)
        self.pending = None if self.done else choice.token


def plan_step(running: list[Sequence], budget: int) -> list[Feed]:
    """The next step's feeds: a token for every sequence that is generating, then prompt chunks of the
    sequences mid-prompt, the shortest remaining prompt first (which minimises the mean time to first token: a
    short prompt joining behind a long one is not held up by it), within `budget` tokens in all. Every feed asks
    for one row of logits at most, but for prompts scored for their own log-probabilities (echo), which share
    ECHO_OUTPUTS rows a step: the engine's output buffer holds one row per sequence plus those."""
    feeds = [Feed(s.slot, (s.pending,), s.pos, 1) for s in running if s.pending is not None]
    room, echo_room = budget - len(feeds), ECHO_OUTPUTS
    for s in sorted(running, key=lambda s: len(s.ids) - s.fed):   # shortest remaining prompt first (stable)
        if room <= 0:
            break
        if s.pending is not None or s.done or s.fed >= len(s.ids) or (s.echo_logprobs and echo_room == 0):
            continue
        n = min(room, len(s.ids) - s.fed, echo_room if s.echo_logprobs else room)
        last = s.fed + n == len(s.ids)
        wanted = n if s.echo_logprobs else int(last)
        echo_room -= n if s.echo_logprobs else 0
        feeds.append(Feed(s.slot, tuple(s.ids[s.fed: s.fed + n]), s.fed, wanted))
        room -= n
    return feeds


class Decoder:
    """Running and waiting sequences over one engine context; `step()` advances all of them."""

    def __init__(self, context: Context, cache: PrefixCache, step_tokens: int, kv_max: int | None = None, *,
                 aligned: bool = False) -> None:
        """`kv_max`: the cells the pool may grow to (default: what it holds now). It grows when admission needs
        room, to twice its size or what is needed: a process that starts on the ladder's critical path opens a
        small pool (zeroing an 8B's 4,096-token pool takes 0.37 s of a zygote child's first request, measured).
        `aligned`: a prefix-cache hit is cut to whole steps, so that the rest of the prompt is fed in the chunks
        a prompt fed from its first token gets, and a stream alone computes the same bits with or without it."""
        self.ctx, self.cache, self.step_tokens = context, cache, step_tokens
        self.align = step_tokens if aligned else 1
        self.kv_max = max(kv_max or 0, context.kv_tokens)
        self.grows = 0
        self.grow_blocked = False   # the engine could not grow the pool: not again until a sequence comes or goes
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.free = list(range(context.slots - 1, -1, -1))
        self.reserved = 0                     # cells the running sequences may reach
        self.decode_steps = 0                 # for tests and benchmarks: steps, and the most rows in one
        self.widest_step = 0

    def add(self, seq: Sequence) -> Sequence:
        if seq.reach > self.kv_max:
            raise ValueError(f"a sequence of {seq.reach} tokens cannot fit a pool of {self.kv_max}")
        self.waiting.append(seq)
        self.grow_blocked = False
        return seq

    def undelivered(self) -> bool:
        """Whether a running sequence holds output its reader has not taken yet."""
        return any(s.outbox for s in self.running)

    def drop(self, seq: Sequence) -> None:
        """Forget `seq` (finished, cancelled or its reader gone); its cells and slot go back."""
        seq.done = True
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot < 0:
            return
        self.ctx.cut(seq.slot)
        self.grow_blocked = False
        self.running.remove(seq)
        self.free.append(seq.slot)
        self.reserved -= seq.reach
        seq.slot = -1

    def step(self) -> None:
        """One iteration: stop checks, admissions, then one batch as `plan_step` plans it."""
        for seq in [*self.running, *self.waiting]:
            if seq.stop is not None and seq.stop():
                seq.outbox.append(Cancelled(f"stopped after {len(seq.generated)} tokens"))
                self.drop(seq)
        self._admit()
        feeds = plan_step(self.running, self.step_tokens)
        if not feeds:
            return
        by_slot = {s.slot: s for s in self.running}
        try:
            logits = self.ctx.run(feeds)
        except Exception as err:   # the batch is lost: each of its sequences fails alone, the instance serves on
            for feed in feeds:
                self._fail(by_slot[feed.seq], err)
            return
        self.decode_steps += 1
        self.widest_step = max(self.widest_step, len(feeds))
        for feed, out in zip(feeds, logits, strict=True):
            try:
                self._advance(by_slot[feed.seq], feed, out)
            except Exception as err:   # one sequence's failure (its grammar, its output) is its own
                self._fail(by_slot[feed.seq], err)

    def _fail(self, seq: Sequence, err: Exception) -> None:
        seq.outbox.append(err)
        self.drop(seq)

    def _advance(self, seq: Sequence, feed: Feed, logits: np.ndarray | None) -> None:
        seq.pos = feed.start + len(feed.tokens)
        if seq.pending is None:   # a prompt chunk
            if seq.echo_logprobs and logits is not None:
                seq.output.prompt_logits(seq.ids, seq.fed, logits)
            seq.fed += len(feed.tokens)
            if seq.fed < len(seq.ids):
                return
            self._remember(seq)
        assert logits is not None
        seq.take(logits[-1])
        if seq.done:
            self.drop(seq)

    def _admit(self) -> None:
        """Waiting sequences take free slots while the pool has room for all they may reach."""
        while self.waiting and self.free:
            seq = self.waiting[0]
            if self.reserved + seq.reach > self.ctx.kv_tokens and not self._grow(self.reserved + seq.reach):
                return
            self.waiting.popleft()
            seq.slot = self.free.pop()
            self.running.append(seq)
            self.reserved += seq.reach
            self._reuse(seq)

    def _grow(self, needed: int) -> bool:
        """Room for `needed` cells: the pool grows (twice its size, or what is needed, at most `kv_max`). False when
        it cannot: the waiting sequences that need more than the pool then fail (the engine could not make it; the
        others wait for room, and an arrival or a departure lets it try again), and if the engine lost the pool on
        the way, the running ones too."""
        if needed > self.kv_max or self.grow_blocked:
            return False
        size = min(self.kv_max, max(needed, 2 * self.ctx.kv_tokens))
        try:
            self.ctx.grow(size, [s.slot for s in self.running])
        except ModelNotReady as err:   # the engine kept the old pool and every running sequence's KV
            self._refuse_beyond(self.ctx.kv_tokens, err)
            self.grow_blocked = True   # until a sequence arrives or leaves: not one attempt per step
            return False
        except Exception as err:       # the pool went with the running sequences' KV
            for seq in list(self.running):
                self._fail(seq, err)
            self._refuse_beyond(0, err)
            return False
        self.grows += 1
        return True

    def _refuse_beyond(self, room: int, err: Exception) -> None:
        for seq in [s for s in self.waiting if s.reach > room]:
            self.waiting.remove(seq)
            seq.outbox.append(err)
            seq.done = True

    def _reuse(self, seq: Sequence) -> None:
        """Start from the longest cached prefix of the prompt, if any (restored, then cut to the match)."""
        if seq.echo_logprobs:
            return
        n, data = self.cache.lookup(seq.ids, seq.scope, self.align)
        if data is None:
            return
        restored = self.ctx.restore(seq.slot, data)
        if restored < n or (restored > n and not self.ctx.cut(seq.slot, n)):   # no room, or no exact cut
            self.ctx.cut(seq.slot)
            return
        seq.fed = seq.cached = seq.pos = n

    def _remember(self, seq: Sequence) -> None:
        """A prompt just completed: its KV goes into the prefix cache (before any generated token joins it)."""
        if self.cache.wants(seq.ids, seq.scope) and self.cache.fits(self.ctx.state_bytes(seq.slot)):
            self.cache.insert(seq.ids, self.ctx.save(seq.slot), seq.scope)
