"""Continuous batching and the prefix cache of the llm runtime, in process, on the real SmolLM2.

Streams of one model share its decoder: whichever generator asks first runs a step for all of them. So pulling
replies from several generators in turn, as the instance server does, batches them; these tests check that a
batched stream gives exactly what it gives alone (greedy, and seeded sampling: no shared random stream), that
a stream joins between two tokens of others, that the limits hold, and that a prefix-cache hit changes nothing
but the work done.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from ember.runtimes.llm import LLMModel, LLMOptions
from ember.wire.contract import ModelContract

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a poem about the sea.", "Name three colours.",
             "What is 2+2?"]
SYSTEM = "You are a careful assistant who answers in full sentences and checks every fact twice. " * 8


def inputs(**fields: Any) -> dict[str, np.ndarray]:
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps(fields).encode()
    return {"request": arr}


def chat(question: str, **fields: Any) -> dict[str, np.ndarray]:
    return inputs(messages=[{"role": "user", "content": question}], **fields)


def text(replies: list[dict[str, np.ndarray]]) -> str:
    return "".join(bytes(r["text"][0]).decode() for r in replies)


def round_robin(streams: list[Iterator[dict[str, np.ndarray]]]) -> list[list[dict[str, np.ndarray]]]:
    """One reply from each live stream in turn, as the instance server takes them."""
    out: list[list[dict[str, np.ndarray]]] = [[] for _ in streams]
    live = set(range(len(streams)))
    while live:
        for i in sorted(live):
            try:
                out[i].append(next(streams[i]))
            except StopIteration:
                live.discard(i)
    return out


def variant(model: LLMModel, **options: Any) -> LLMModel:
    """The same weights with other options or a smaller max_concurrency (a new decoder, same mmapped file)."""
    scaling = options.pop("max_concurrency", None)
    contract: ModelContract = model.contract
    if scaling is not None:
        contract = contract.model_copy(update={"scaling": contract.scaling.model_copy(
            update={"max_concurrency": scaling})})
    return LLMModel(contract, model.root, LLMOptions(**{**model.options.model_dump(), **options}))


def test_batched_greedy_streams_equal_each_stream_alone(smollm2: LLMModel) -> None:
    lengths = [24, 12, 30, 6]
    alone = [text(list(smollm2.stream(chat(q, temperature=0, max_tokens=n)))) for q, n in zip(QUESTIONS, lengths,
                                                                                             strict=True)]
    steps_before = smollm2.decoder.decode_steps
    together = round_robin([smollm2.stream(chat(q, temperature=0, max_tokens=n))
                            for q, n in zip(QUESTIONS, lengths, strict=True)])
    assert [text(r) for r in together] == alone
    assert [int(r[-1]["completion_tokens"][0]) for r in together] == [len(r) for r in together]
    assert smollm2.decoder.widest_step == len(QUESTIONS)   # all four decoded in one pass
    assert smollm2.decoder.decode_steps - steps_before < sum(lengths) / 2


def test_seeded_sampling_in_a_batch_equals_the_same_seed_alone(smollm2: LLMModel) -> None:
    fields = [{"temperature": 1.1, "top_p": 0.9, "seed": s, "max_tokens": 16} for s in (7, 8, 9)]
    alone = [text(list(smollm2.stream(inputs(prompt="Once upon a time", **f)))) for f in fields]
    together = round_robin([smollm2.stream(inputs(prompt="Once upon a time", **f)) for f in fields])
    assert [text(r) for r in together] == alone
    assert len(set(alone)) > 1


def test_a_new_stream_starts_between_two_tokens_of_a_running_one(smollm2: LLMModel) -> None:
    first = smollm2.stream(chat(QUESTIONS[1], temperature=0, max_tokens=40))
    early = [next(first) for _ in range(3)]
    second = smollm2.stream(chat(QUESTIONS[0], temperature=0, max_tokens=5))
    late = list(second)   # runs steps for both: the first stream keeps decoding meanwhile
    assert bytes(late[-1]["finish_reason"][0]) in (b"stop", b"length")
    rest = list(first)
    assert int(rest[-1]["completion_tokens"][0]) == 40 and len(early) + len(rest) == 40
    assert text(early + rest) == text(list(smollm2.stream(chat(QUESTIONS[1], temperature=0, max_tokens=40))))


def test_a_closed_stream_leaves_and_the_others_finish_unchanged(smollm2: LLMModel) -> None:
    alone = text(list(smollm2.stream(chat(QUESTIONS[2], temperature=0, max_tokens=20))))
    leaving = smollm2.stream(chat(QUESTIONS[1], temperature=0, max_tokens=40))
    staying = smollm2.stream(chat(QUESTIONS[2], temperature=0, max_tokens=20))
    got = [next(staying), next(leaving), next(staying), next(leaving)]
    leaving.close()   # the instance server closes a cancelled stream: its slot goes to the others
    got += list(staying)
    assert text(got[:1] + got[2:3] + got[4:]) == alone
    assert smollm2.decoder.running == [] and not smollm2.decoder.waiting


def test_streams_beyond_max_concurrency_wait_for_a_slot(smollm2: LLMModel) -> None:
    narrow = variant(smollm2, max_concurrency=2)
    alone = [text(list(narrow.stream(chat(q, temperature=0, max_tokens=8)))) for q in QUESTIONS[:3]]
    together = round_robin([narrow.stream(chat(q, temperature=0, max_tokens=8)) for q in QUESTIONS[:3]])
    assert [text(r) for r in together] == alone
    assert narrow.decoder.widest_step == 2


def test_tokens_in_flight_bound_the_batch(smollm2: LLMModel) -> None:
    tight = variant(smollm2, max_tokens_in_flight=60)   # room for one ~40-token prompt plus 8 tokens at a time
    together = round_robin([tight.stream(chat(q, temperature=0, max_tokens=8)) for q in QUESTIONS[:3]])
    assert all(bytes(r[-1]["finish_reason"][0]) for r in together)
    assert tight.decoder.widest_step == 1


def test_a_prefix_cache_hit_skips_the_prefill_and_changes_no_token(smollm2: LLMModel) -> None:
    uncached = variant(smollm2, prefix_cache_mb=0)
    cached = variant(smollm2)
    messages = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS[:3]]
    replies = [list(cached.stream(inputs(messages=m, temperature=0, max_tokens=16))) for m in messages]
    hits = [int(r[-1]["cached_tokens"][0]) for r in replies]
    prompt = int(replies[0][-1]["prompt_tokens"][0])
    assert hits[0] == 0 and all(h > prompt * 0.8 for h in hits[1:]), (hits, prompt)
    expected = [text(list(uncached.stream(inputs(messages=m, temperature=0, max_tokens=16)))) for m in messages]
    assert [text(r) for r in replies] == expected
    assert cached.decoder.cache.hits == 2 and uncached.decoder.cache.hits == 0
