"""The llm runtime's scheduler: `plan_step` and the `Decoder`'s admission by KV cells, over a fake engine context.

`FakeContext` checks what llama.cpp would refuse (a position written out of order, more cells than the pool)
and answers logits that depend only on a sequence's own history, so a sequence's tokens are the same alone or in
any batch exactly when the decoder feeds each sequence what it should.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.errors import Cancelled, ModelFailed, ModelNotReady
from ember.runtimes.llm_decoder import Decoder, Sequence, Token, plan_step
from ember.runtimes.llm_engine import ECHO_OUTPUTS, Feed
from ember.runtimes.llm_output import Output
from ember.runtimes.llm_prefix import PrefixCache
from ember.runtimes.llm_sampling import Sampler

VOCAB = 97


class FakeContext:
    """KV memory for `slots` sequences sharing `kv_tokens` cells: each sequence's cells hold its tokens."""

    def __init__(self, slots: int, kv_tokens: int) -> None:
        self.slots, self.kv_tokens = slots, kv_tokens
        self.kv: dict[int, list[int]] = {s: [] for s in range(slots)}
        self.steps: list[list[Feed]] = []
        self.most_used = 0
        self.saves = self.restores = 0
        self.refuse_restore = False
        self.refuse_grow = False   # the engine cannot make the larger pool and keeps this one
        self.lose_on_grow = False  # nor this one: the pool is lost
        self.grown: list[int] = []
        self.threads = 1
        self.can_cut = True

    @property
    def used(self) -> int:
        return sum(len(cells) for cells in self.kv.values())

    def set_threads(self, threads: int) -> None:
        self.threads = threads

    def run(self, feeds: list[Feed]) -> list[np.ndarray | None]:
        self.steps.append(feeds)
        assert len({f.seq for f in feeds}) == len(feeds), "a sequence fed twice in one step"
        out: list[np.ndarray | None] = []
        for feed in feeds:
            cells = self.kv[feed.seq]
            assert feed.start == len(cells), f"sequence {feed.seq}: position {feed.start} after {len(cells)} cells"
            assert 0 <= feed.outputs <= len(feed.tokens)
            cells.extend(feed.tokens)
            if self.used > self.kv_tokens:
                raise RuntimeError("llama_decode failed (1: no KV cell free)")
            rows = [next_logits(cells[: len(cells) - feed.outputs + 1 + r]) for r in range(feed.outputs)]
            out.append(np.stack(rows) if rows else None)
        self.most_used = max(self.most_used, self.used)
        return out

    def cut(self, seq: int, start: int = 0) -> bool:
        if start and not self.can_cut:
            return False
        del self.kv[seq][start:]
        return True

    def state_bytes(self, seq: int) -> int:
        return 4 * len(self.kv[seq])

    def save(self, seq: int) -> bytes:
        self.saves += 1
        return np.asarray(self.kv[seq], dtype=np.int32).tobytes()

    def restore(self, seq: int, data: bytes) -> int:
        assert not self.kv[seq], "restored into a sequence that holds cells"
        tokens = np.frombuffer(data, dtype=np.int32).tolist()
        if self.refuse_restore or self.used + len(tokens) > self.kv_tokens:
            return 0
        self.restores += 1
        self.kv[seq] = tokens
        return len(tokens)

    def grow(self, kv_tokens: int, live: list[int]) -> None:
        assert kv_tokens > self.kv_tokens, "a pool grows"
        assert all(not cells for s, cells in self.kv.items() if s not in live), "a sequence's KV left behind"
        if self.lose_on_grow:
            self.kv = {s: [] for s in self.kv}
            raise ModelFailed("llama.cpp: the KV pool was lost while growing it")
        if self.refuse_grow:
            raise ModelNotReady(f"llama.cpp could not open a context of {kv_tokens} tokens")
        self.kv_tokens = kv_tokens
        self.grown.append(kv_tokens)

    def close(self) -> None:
        pass


def next_token(history: list[int]) -> int:
    """The fake model's greedy choice after `history` (a hash of all of it: feeding one wrong token shows)."""
    return (sum((i + 1) * t for i, t in enumerate(history)) * 31 + len(history)) % VOCAB


def next_logits(history: list[int]) -> np.ndarray:
    logits = np.zeros(VOCAB, dtype=np.float32)
    logits[next_token(history)] = 10.0
    return logits


def expected(ids: list[int], limit: int) -> list[int]:
    history, out = list(ids), []
    for _ in range(limit):
        out.append(next_token(history))
        history.append(out[-1])
    return out


def seq(ids: list[int], limit: int, stop: Callable[[], bool] | None = None, *, echo: bool = False, top: int = 0,
        eos: frozenset[int] = frozenset()) -> Sequence:
    output = Output(lambda t: f"<{t}>".encode(), eos, (), logprobs=echo, top_logprobs=top)
    sampler = Sampler(0.0, 1.0, None, logprobs=echo, top_logprobs=top)
    return Sequence(list(ids), limit, stop, sampler, output, echo_logprobs=echo)


def prompt(n: int, start: int = 1) -> list[int]:
    return [(start + i) % VOCAB for i in range(n)]


def decoder(slots: int = 4, kv_tokens: int = 1000, step_tokens: int = 16,
            cache: PrefixCache | None = None, kv_start: int | None = None) -> tuple[Decoder, FakeContext]:
    """`kv_start`: the pool the context opens with (default `kv_tokens`), growing to `kv_tokens`."""
    ctx = FakeContext(slots, kv_start or kv_tokens)
    return Decoder(ctx, cache if cache is not None else PrefixCache(0), step_tokens, kv_max=kv_tokens), ctx


def run(dec: Decoder, *seqs: Sequence, steps: int = 10_000) -> None:
    for _ in range(steps):
        if all(s.done for s in seqs):
            return
        dec.step()
    raise AssertionError("the sequences did not finish")


def tokens_of(s: Sequence) -> list[Token]:
    return [t for t in s.outbox if isinstance(t, Token)]


# --- plan_step: a pure function of the running sequences --------------------------------------------


def state(ids: list[int], slot: int, *, fed: int = 0, pending: int | None = None, echo: bool = False) -> Sequence:
    s = seq(ids, 10, echo=echo)
    s.slot, s.fed, s.pending = slot, fed, pending
    s.pos = fed if pending is None else len(ids) + 3
    return s


def test_decode_rows_come_first_then_prompt_chunks_shortest_remaining_first_within_the_budget() -> None:
    long_ = state(prompt(30), 1, fed=10)
    decoding = state(prompt(5), 0, fed=5, pending=42)
    fresh = state(prompt(8, 50), 2)
    other = state(prompt(6), 3, fed=6, pending=7)
    running = [long_, decoding, fresh, other]
    # The fresh prompt has 8 tokens left, the long one 20: the fresh one goes first.
    assert plan_step(running, 16) == [Feed(0, (42,), 8, 1), Feed(3, (7,), 9, 1),
                                      Feed(2, tuple(fresh.ids), 0, 1),             # its whole prompt: logits
                                      Feed(1, tuple(long_.ids[10:16]), 10, 0)]     # mid-prompt: no logits
    assert plan_step(running, 40) == [Feed(0, (42,), 8, 1), Feed(3, (7,), 9, 1),
                                      Feed(2, tuple(fresh.ids), 0, 1),
                                      Feed(1, tuple(long_.ids[10:30]), 10, 1)]     # its last chunk: logits
    assert plan_step(running, 7) == [Feed(0, (42,), 8, 1), Feed(3, (7,), 9, 1),
                                     Feed(2, tuple(fresh.ids[:5]), 0, 0)]
    assert plan_step(running, 2) == [Feed(0, (42,), 8, 1), Feed(3, (7,), 9, 1)]   # no room: decode only


def test_finished_sequences_are_not_fed_and_an_empty_plan_is_empty() -> None:
    done = state(prompt(5), 0, fed=5)
    done.done = True
    assert plan_step([done], 16) == [] and plan_step([], 16) == []


def test_a_prompt_that_wants_its_own_logprobs_asks_for_every_row_in_chunks() -> None:
    echo = state(prompt(150), 0, echo=True)
    plain = state(prompt(20, 60), 1)
    feeds = plan_step([echo, plain], 512)
    assert feeds == [Feed(1, tuple(plain.ids), 0, 1), Feed(0, tuple(echo.ids[:ECHO_OUTPUTS]), 0, ECHO_OUTPUTS)]
    echo.fed = 128
    assert plan_step([echo], 512) == [Feed(0, tuple(echo.ids[128:]), 128, 22)]


# --- the decoder: batching, chunked prefill, admission by cells ---------------------------------------


def test_a_sequence_alone_generates_what_the_model_gives() -> None:
    dec, ctx = decoder()
    s = dec.add(seq(prompt(10), 6))
    run(dec, s)
    assert s.generated == expected(s.ids, 6)
    tokens = tokens_of(s)
    assert [t.completion_tokens for t in tokens] == [1, 2, 3, 4, 5, 6]
    assert [t.finish for t in tokens] == [""] * 5 + ["length"] and all(t.prompt_tokens == 10 for t in tokens)
    assert "".join(t.text for t in tokens) == "".join(f"<{t}>" for t in s.generated)
    assert ctx.used == 0 and dec.reserved == 0 and not dec.running and sorted(dec.free) == [0, 1, 2, 3]


def test_a_long_prompt_is_spread_over_steps_while_another_sequence_decodes() -> None:
    dec, ctx = decoder(step_tokens=16)
    a = dec.add(seq(prompt(5), 30))
    dec.step()   # a's prompt, and its first token
    b = dec.add(seq(prompt(50, 40), 3))
    while not b.generated:
        dec.step()
    joined = ctx.steps[1:]
    assert len(joined) == 4   # 15 + 15 + 15 + 5 prompt tokens beside one decode row each
    for feeds in joined:
        assert feeds[0].seq == a.slot and len(feeds[0].tokens) == 1   # a decodes first, every step
        assert sum(len(f.tokens) for f in feeds) <= 16
    assert [len(f[1].tokens) for f in joined] == [15, 15, 15, 5] and [f[1].outputs for f in joined] == [0, 0, 0, 1]
    assert len(a.generated) == 5   # one token per step, never held up by b's prompt
    run(dec, a, b)
    assert a.generated == expected(a.ids, 30) and b.generated == expected(b.ids, 3)


def test_interleaved_sequences_generate_what_each_does_alone() -> None:
    dec, ctx = decoder(slots=4, step_tokens=24)
    seqs = [dec.add(seq(prompt(n, 7 * n), limit)) for n, limit in [(30, 12), (3, 20), (17, 5), (40, 9)]]
    run(dec, *seqs)
    for s in seqs:
        assert s.generated == expected(s.ids, s.limit)
    assert dec.widest_step == 4 and all(sum(len(f.tokens) for f in feeds) <= 24 for feeds in ctx.steps)
    assert ctx.used == 0 and dec.reserved == 0


def test_admission_waits_for_cells_and_admits_when_they_come_back() -> None:
    dec, ctx = decoder(slots=4, kv_tokens=100, step_tokens=64)
    a = dec.add(seq(prompt(20), 40))   # reaches 60 cells
    b = dec.add(seq(prompt(10, 30), 40))   # reaches 50: 60 + 50 > 100
    c = dec.add(seq(prompt(5, 50), 5))    # reaches 10: fits, but waits behind b (admission in join order)
    dec.step()
    assert dec.running == [a] and list(dec.waiting) == [b, c] and dec.reserved == 60
    while not a.done:
        dec.step()
        assert b.slot < 0 and not b.generated
    dec.step()   # a left: its cells came back, b and c are admitted
    assert dec.running == [b, c] and dec.reserved == 60 and b.generated and c.generated
    run(dec, b, c)
    assert a.generated == expected(a.ids, 40) and b.generated == expected(b.ids, 40)
    assert c.generated == expected(c.ids, 5)
    assert ctx.most_used <= 100


def test_the_slots_bound_the_running_set() -> None:
    dec, _ = decoder(slots=2)
    seqs = [dec.add(seq(prompt(4, 10 * i), 6)) for i in range(3)]
    dec.step()
    assert len(dec.running) == 2 and list(dec.waiting) == [seqs[2]]
    run(dec, *seqs)
    assert dec.widest_step == 2 and all(s.generated == expected(s.ids, 6) for s in seqs)


def test_dropping_a_sequence_returns_its_cells_and_slot() -> None:
    dec, ctx = decoder(slots=2, kv_tokens=100, step_tokens=64)
    a = dec.add(seq(prompt(20), 30))
    b = dec.add(seq(prompt(20, 5), 30))
    w = dec.add(seq(prompt(5, 9), 5))
    for _ in range(3):
        dec.step()
    slot = a.slot
    assert len(ctx.kv[slot]) == 22 and dec.reserved == 100
    dec.drop(a)   # its reader went away mid-generation
    assert ctx.kv[slot] == [] and dec.reserved == 50 and slot in dec.free and a.slot == -1 and a.done
    dec.drop(a)   # twice is harmless
    assert dec.reserved == 50
    dec.drop(w)   # a waiting one just leaves the queue
    assert not dec.waiting
    run(dec, b)
    assert b.generated == expected(b.ids, 30) and ctx.used == 0 and dec.reserved == 0


def test_a_sequence_that_cannot_fit_the_pool_alone_is_refused() -> None:
    dec, ctx = decoder(kv_tokens=100)
    with pytest.raises(ValueError, match="a sequence of 101 tokens cannot fit a pool of 100"):
        dec.add(seq(prompt(51), 50))
    assert not dec.waiting
    s = dec.add(seq(prompt(50), 50))   # exactly the pool: served
    run(dec, s)
    assert ctx.most_used == 99   # the last token is never fed


def test_a_stopped_sequence_gets_cancelled_and_the_others_go_on() -> None:
    dec, _ = decoder()
    asked = {"stop": False}
    a = dec.add(seq(prompt(8), 20, lambda: asked["stop"]))
    b = dec.add(seq(prompt(8, 3), 10))
    for _ in range(4):
        dec.step()
    asked["stop"] = True
    dec.step()
    assert isinstance(a.outbox[-1], Cancelled) and a.done and a not in dec.running
    assert str(a.outbox[-1]) == "stopped after 4 tokens"
    run(dec, b)
    assert b.generated == expected(b.ids, 10)
    waiting = seq(prompt(4), 5, lambda: True)   # stopped before it was admitted
    dec.add(waiting)
    dec.step()
    assert isinstance(waiting.outbox[-1], Cancelled) and not dec.waiting


def test_a_cached_prefix_is_restored_cut_to_the_match_and_changes_no_token() -> None:
    dec, ctx = decoder(cache=PrefixCache(1 << 20))
    first = dec.add(seq(prompt(40), 4))
    run(dec, first)
    assert ctx.saves == 1 and len(dec.cache) == 1   # its prompt, before any generated token joined it
    second = dec.add(seq([*prompt(30), 90, 91, 92], 6))
    dec.step()
    assert ctx.restores == 1 and second.cached == 30
    assert ctx.steps[-1] == [Feed(second.slot, (90, 91, 92), 30, 1)]   # only what the cache lacked
    run(dec, second)
    assert second.generated == expected(second.ids, 6)
    assert tokens_of(second)[-1].cached_tokens == 30
    same = dec.add(seq(prompt(40), 4))   # the same prompt: all but its last token come from the cache
    run(dec, same)
    assert same.cached == 39 and same.generated == first.generated


def test_a_restore_that_does_not_fit_is_computed_instead() -> None:
    dec, ctx = decoder(cache=PrefixCache(1 << 20))
    run(dec, dec.add(seq(prompt(40), 4)))
    ctx.refuse_restore = True
    s = dec.add(seq([*prompt(30), 5], 4))
    run(dec, s)
    assert s.cached == 0 and s.generated == expected(s.ids, 4) and ctx.restores == 0


def test_an_echoed_prompt_with_logprobs_bypasses_the_cache_and_gets_every_rows_logits() -> None:
    dec, ctx = decoder(step_tokens=512, cache=PrefixCache(1 << 20))
    run(dec, dec.add(seq(prompt(100), 2)))
    echo = dec.add(seq(prompt(100), 2, echo=True))
    dec.step()
    assert echo.cached == 0 and ctx.restores == 0
    assert ctx.steps[-1] == [Feed(echo.slot, tuple(echo.ids[:ECHO_OUTPUTS]), 0, ECHO_OUTPUTS)]
    run(dec, echo)
    assert echo.generated == expected(echo.ids, 2)
    entries = tokens_of(echo)[0].logprobs
    assert entries is not None and len(entries) == 101   # every prompt token, then the first generated one
    assert entries[0]["logprob"] is None and all(e["logprob"] is not None for e in entries[1:])


def test_echoed_prompt_tokens_carry_their_top_alternatives() -> None:
    """Each prompt token after the first carries the `top` most likely tokens in its place, from the logits of the
    tokens before it (what lm-eval's parse_logprobs reads to tell a greedy continuation); the first has none."""
    dec, _ = decoder(step_tokens=512)
    ids = prompt(40)
    ids[10] = next_token(ids[:10])   # one prompt token the fake model would have chosen itself
    echo = dec.add(seq(ids, 2, echo=True, top=2))
    run(dec, echo)
    entries = tokens_of(echo)[0].logprobs
    assert entries is not None and len(entries) == 41
    assert entries[0]["logprob"] is None and entries[0]["top_logprobs"] == []
    for k, entry in enumerate(entries[1:40], start=1):
        top = entry["top_logprobs"]
        assert len(top) == 2 and top[0]["token"] == f"<{next_token(ids[:k])}>" and top[0]["logprob"] > top[1]["logprob"]
        assert (entry["logprob"] == top[0]["logprob"]) == (ids[k] == next_token(ids[:k]))
    assert entries[10]["logprob"] == entries[10]["top_logprobs"][0]["logprob"]


def test_the_end_of_sequence_token_is_not_counted_among_the_completions_tokens() -> None:
    """As llama.cpp's server and vLLM count: a completion that ends on its end-of-sequence token counts the tokens
    before it, in every reply."""
    ids = prompt(10)
    eos = frozenset({expected(ids, 3)[2]})
    dec, _ = decoder()
    s = dec.add(seq(ids, 6, eos=eos))
    run(dec, s)
    tokens = tokens_of(s)
    assert len(s.generated) == 3 and s.generated[-1] in eos
    assert [t.completion_tokens for t in tokens] == [1, 2, 2] and [t.finish for t in tokens] == ["", "", "stop"]


@settings(max_examples=60, deadline=None)
@given(plan=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30), st.integers(0, 40), st.booleans()),
                     min_size=1, max_size=10),
       slots=st.integers(1, 5), kv_tokens=st.integers(90, 300), step_tokens=st.integers(16, 64),
       cache_mb=st.sampled_from([0, 1]), kv_start=st.sampled_from([None, 16, 50]))
def test_any_arrivals_and_leavings_keep_the_pool_and_every_sequences_tokens(
        plan: list[tuple[int, int, int, bool]], slots: int, kv_tokens: int, step_tokens: int,
        cache_mb: int, kv_start: int | None) -> None:
    """Sequences (prompt length, limit, the step they arrive at, whether their reader leaves early) join and
    leave at random, with the pool growing from `kv_start`; every step stays within the budget and the pool,
    and each finished one has its tokens."""
    dec, ctx = decoder(slots=slots, kv_tokens=kv_tokens, step_tokens=step_tokens, cache=PrefixCache(cache_mb << 20),
                       kv_start=kv_start)
    arrivals = sorted(((at, i, n, limit, leaves) for i, (n, limit, at, leaves) in enumerate(plan)),
                      key=lambda a: a[:2])
    live: list[tuple[Sequence, bool]] = []
    finished: list[Sequence] = []
    for step in itertools.count():
        while arrivals and arrivals[0][0] <= step:
            _, i, n, limit, leaves = arrivals.pop(0)
            s = seq(prompt(n, 11 * (i % 2)), min(limit, kv_tokens - n))   # shared starts: cache hits
            live.append((dec.add(s), leaves))
        for s, leaves in list(live):
            if s.done or (leaves and len(s.generated) >= 2):
                dec.drop(s)
                live.remove((s, leaves))
                if not leaves:
                    finished.append(s)
        if not live and not arrivals:
            break
        dec.step()
        assert all(sum(len(f.tokens) for f in feeds) <= step_tokens for feeds in ctx.steps[-1:])
        assert ctx.used <= ctx.kv_tokens <= kv_tokens and dec.reserved <= ctx.kv_tokens
        assert len(dec.running) <= slots
        assert step < 5000
    for s in finished:
        assert s.generated == expected(s.ids, s.limit)
    assert ctx.used == 0 and dec.reserved == 0 and sorted(dec.free) == list(range(slots))


def test_a_small_pool_grows_as_sequences_need_it_and_each_keeps_its_tokens() -> None:
    """Opened at 64 cells with room for 1,000: a second sequence joining a running one doubles the pool (the
    running one's KV carried over mid-stream), a long one takes it to what it needs; outputs are unchanged."""
    dec, ctx = decoder(kv_tokens=1000, kv_start=64, step_tokens=64)
    first = dec.add(seq(prompt(20), 30))
    for _ in range(5):
        dec.step()
    second = dec.add(seq(prompt(30, 5), 10))
    long = dec.add(seq(prompt(300, 9), 20))
    run(dec, first, second, long)
    assert ctx.grown == [128, 410]   # twice 64; then what all three reach (50 + 40 + 320)
    assert dec.grows == 2
    for s in (first, second, long):
        assert s.generated == expected(s.ids, s.limit)


def test_a_pool_the_engine_cannot_grow_fails_only_the_sequences_that_need_it() -> None:
    """The engine keeps its pool: a sequence that needs more fails (ModelNotReady: a 503, not a 500), one that fits
    the pool waits for room, and a later arrival tries the growth again."""
    dec, ctx = decoder(kv_tokens=1000, kv_start=100, step_tokens=64)
    ctx.refuse_grow = True
    small = dec.add(seq(prompt(20), 10))
    big = dec.add(seq(prompt(200, 3), 10))
    waits = dec.add(seq(prompt(60, 5), 10))    # fits the pool once `small` is done
    run(dec, small, big, waits)
    assert small.generated == expected(small.ids, 10) and waits.generated == expected(waits.ids, 10)
    assert any(isinstance(item, ModelNotReady) for item in big.outbox)
    assert ctx.grown == [] and dec.kv_max == 1000
    ctx.refuse_grow = False
    again = dec.add(seq(prompt(200, 3), 10))
    run(dec, again)
    assert again.generated == expected(again.ids, 10) and ctx.grown == [210]


def test_a_pool_lost_while_growing_fails_the_running_sequences_not_the_process() -> None:
    dec, ctx = decoder(kv_tokens=1000, kv_start=100, step_tokens=64)
    running = dec.add(seq(prompt(20), 30))
    for _ in range(3):
        dec.step()
    ctx.lose_on_grow = True
    big = dec.add(seq(prompt(200, 3), 10))
    dec.step()
    assert running.done and any(isinstance(item, ModelFailed) for item in running.outbox)
    assert big.done and any(isinstance(item, ModelFailed) for item in big.outbox)
    assert dec.running == [] and dec.reserved == 0
