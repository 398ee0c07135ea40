"""The llm runtime against transformers: same prompt tokens, same greedy tokens, a sensible answer.

The reference is transformers' own GGUF loader (`from_pretrained(..., gguf_file=...)`, which de-quantises the
file itself) and its own `generate` (greedy): an independent path from the file to the tokens, so a wrong
tensor name, a missed rope permutation or a decode-loop slip in ember shows as a token mismatch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from ember.runtimes.llm import LLMModel
from ember.runtimes.llm_request import Request, parse_request
from ember.wire.contract import example_contracts_dir, load_contract

pytestmark = pytest.mark.slow

SMOLLM2 = load_contract(example_contracts_dir() / "smollm2.yaml")
NEW_TOKENS = 24
PROMPTS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Describe the sea."}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "user", "content": "Name a prime number."}, {"role": "assistant", "content": "7."},
     {"role": "user", "content": "Three more, with a word on each, please. Ünïcödé ✓"}],
]


def request(**fields: Any) -> Request:
    return parse_request(json.dumps(fields).encode())


def inputs(**fields: Any) -> dict[str, np.ndarray]:
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps(fields).encode()
    return {"request": arr}


@pytest.fixture(scope="module")
def model(smollm2: LLMModel) -> LLMModel:
    """The same weights without a prefix cache: parity is about the forward pass. (KV reused from another pass
    may differ from recomputing it in the last bits, as in any prefix cache: test_llm_batching checks hits.)"""
    options = smollm2.options.model_copy(update={"prefix_cache_mb": 0})
    return LLMModel(smollm2.contract, smollm2.root, options)


@pytest.fixture(scope="module")
def reference() -> Iterator[tuple[Any, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = SMOLLM2.weights_path()
    assert gguf is not None
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32").eval()
    yield tokenizer, reference


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_greedy_tokens_equal_transformers_generate(model: LLMModel, reference: tuple[Any, Any], index: int) -> None:
    import torch

    tokenizer, hf = reference
    messages = PROMPTS[index]
    req = request(messages=messages, temperature=0, max_tokens=NEW_TOKENS)
    ids = model.prompt_ids(req)
    expected_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
    assert ids == list(expected_ids)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = out[0, len(ids):].tolist()
    assert list(model.tokens(ids, req, NEW_TOKENS)) == expected
    replies = list(model.stream(inputs(messages=messages, temperature=0, max_tokens=NEW_TOKENS)))
    text = "".join(bytes(r["text"][0]).decode() for r in replies)
    assert text == tokenizer.decode(expected, skip_special_tokens=True)
    assert [int(r["completion_tokens"][0]) for r in replies] == list(range(1, len(expected) + 1))
    finish = bytes(replies[-1]["finish_reason"][0]).decode()
    assert finish == ("stop" if expected[-1] in model.eos else "length")


def test_the_capital_of_france_is_paris(model: LLMModel) -> None:
    out = model.infer(inputs(messages=PROMPTS[0], temperature=0))
    assert "Paris" in bytes(out["text"][0]).decode()
    assert bytes(out["finish_reason"][0]) == b"stop" and int(out["prompt_tokens"][0]) > 0


def test_a_seed_fixes_a_sampled_completion_and_other_seeds_differ(model: LLMModel) -> None:
    def sampled(seed: int) -> str:
        out = model.infer(inputs(prompt="Once upon a time", temperature=1.2, max_tokens=12, seed=seed))
        return bytes(out["text"][0]).decode()

    assert sampled(1) == sampled(1)
    assert len({sampled(1), sampled(2), sampled(3)}) > 1
