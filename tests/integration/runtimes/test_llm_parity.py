"""The llm runtime against llama.cpp used directly: same prompt tokens, same greedy tokens, same text.

The reference is llama-cpp-python's high-level `Llama` on the same GGUF (its own chat formatter, its own
context, its own greedy sampler): ember's chat template rendering, batching, KV bookkeeping and sampling all sit
between the file and the tokens, so a slip in any of them shows as a token mismatch. One setting must match:
ember leaves llama.cpp's flash attention on AUTO (on for the CPU), `Llama` turns it off unless asked, and the two
kernels round differently (SmolLM2 parts with the other path after about 7 tokens on the first prompt).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from ember.runtimes.llm import LLMModel
from ember.testing.gguf_models import direct_llama
from ember.wire.generation import Request, parse_request

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
PROMPTS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Describe the sea."}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "user", "content": "Name a prime number."}, {"role": "assistant", "content": "7."},
     {"role": "user", "content": "Three more, with a word on each, please. Ünïcödé ✓"}],
]


def parse(**fields: Any) -> Request:
    return parse_request(json.dumps(fields).encode())


def inputs(**fields: Any) -> dict[str, np.ndarray]:
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps(fields).encode()
    return {"request": arr}


@pytest.fixture(scope="module")
def uncached(smollm2: LLMModel) -> LLMModel:
    """The same weights without a prefix cache: every prompt computed from its first token."""
    return LLMModel(smollm2.contract, smollm2.engine, smollm2.options.model_copy(update={"prefix_cache_mb": 0}),
                    smollm2.model_id)


@pytest.fixture(scope="module")
def reference(smollm2: LLMModel) -> Iterator[Any]:
    gguf = smollm2.contract.weights_path()
    assert gguf is not None
    llm = direct_llama(gguf, n_ctx=2048, n_threads=1, n_threads_batch=1, flash_attn=True)
    yield llm
    llm.close()


def reference_prompt(llm: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt as llama-cpp-python formats it from the GGUF's chat template, as token ids."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata["tokenizer.chat_template"]
    eos = llm.detokenize([llm.token_eos()], special=True).decode()
    bos = llm.detokenize([llm.token_bos()], special=True).decode() if llm.token_bos() >= 0 else ""
    prompt = Jinja2ChatFormatter(template, eos_token=eos, bos_token=bos)(messages=messages).prompt  # type: ignore[arg-type]
    return list(llm.tokenize(prompt.encode(), add_bos=False, special=True))


def reference_greedy(llm: Any, ids: list[int], eos: frozenset[int], n: int) -> list[int]:
    out: list[int] = []
    for token in llm.generate(ids, temp=0.0, reset=True):
        out.append(int(token))
        if len(out) == n or token in eos:
            break
    return out


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_greedy_tokens_equal_llama_cpp_used_directly(smollm2: LLMModel, uncached: LLMModel, reference: Any,
                                                     index: int) -> None:
    messages = PROMPTS[index]
    req = parse(messages=messages, temperature=0, max_tokens=NEW_TOKENS)
    ids = uncached.prompt_ids(req)
    assert ids == reference_prompt(reference, messages)
    expected = reference_greedy(reference, ids, smollm2.eos, NEW_TOKENS)
    assert uncached.tokens(ids, req, NEW_TOKENS) == expected
    # Streamed through the model the template made (its warmup prefix cached): the same tokens, as text.
    replies = list(smollm2.stream(inputs(messages=messages, temperature=0, max_tokens=NEW_TOKENS)))
    text = "".join(bytes(r["text"][0]).decode() for r in replies)
    assert text == reference.detokenize([t for t in expected if t not in smollm2.eos]).decode()
    ended = expected[-1] in smollm2.eos   # an end-of-sequence token is not counted (as llama.cpp's server counts)
    assert [int(r["completion_tokens"][0]) for r in replies] == [*range(1, len(expected)), len(expected) - ended]
    assert bytes(replies[-1]["finish_reason"][0]) == (b"stop" if expected[-1] in smollm2.eos else b"length")
    assert int(replies[-1]["prompt_tokens"][0]) == len(ids)


def test_a_chat_completion_of_llama_cpp_has_the_same_text(smollm2: LLMModel, reference: Any) -> None:
    messages = PROMPTS[1]
    expected = reference.create_chat_completion(messages, temperature=0.0, max_tokens=NEW_TOKENS)["choices"][0]
    out = smollm2.infer(inputs(messages=messages, temperature=0, max_tokens=NEW_TOKENS))
    assert bytes(out["text"][0]).decode() == expected["message"]["content"]
    assert bytes(out["finish_reason"][0]).decode() == expected["finish_reason"]


def test_a_seed_fixes_a_sampled_completion_and_other_seeds_differ(smollm2: LLMModel) -> None:
    def sampled(seed: int) -> str:
        out = smollm2.infer(inputs(prompt="Once upon a time", temperature=1.2, max_tokens=12, seed=seed))
        return bytes(out["text"][0]).decode()

    first = sampled(1)
    assert sampled(1) == first
    assert sampled(2) != first


def test_repeatable_gives_the_same_greedy_tokens_with_and_without_a_prefix_cache_hit(smollm2: LLMModel) -> None:
    """`options.repeatable`: a hit is cut to whole steps, so the tail is fed in the chunks a cold prompt gets."""
    small = {"step_tokens": 64}
    cold = LLMModel(smollm2.contract, smollm2.engine,
                    smollm2.options.model_copy(update={**small, "prefix_cache_mb": 0}), smollm2.model_id)
    repeatable = LLMModel(smollm2.contract, smollm2.engine,
                          smollm2.options.model_copy(update={**small, "repeatable": True}), smollm2.model_id)
    system = " ".join(f"Rule {i}: a {w} may be traded for two {v}s after turn {i % 5 + 2}." for i, (w, v) in
                      enumerate(zip(["river", "lantern", "falcon", "copper", "meadow"] * 5,
                                    ["harbor", "thistle", "granite", "orchard", "willow"] * 5, strict=True)))
    for question in ["Who moves first?", "How does a player win?", "What happens on a tie?"]:
        req = parse(messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
                    temperature=0, max_tokens=NEW_TOKENS)
        ids = cold.prompt_ids(req)
        assert repeatable.tokens(ids, req, NEW_TOKENS) == cold.tokens(ids, req, NEW_TOKENS)
    cache = repeatable.decoder.cache
    assert cache.hits >= 2 and cache.hit_tokens % 64 == 0 and cache.hit_tokens >= 2 * 128
