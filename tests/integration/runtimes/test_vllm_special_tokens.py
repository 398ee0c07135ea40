"""Which tool-call openings are special tokens (their text dropped by vLLM's `skip_special_tokens`): the vllm
runtime keeps special tokens in the text while tools are asked for only where the opening is one. A real Hugging
Face tokenizer (SmolLM2's, from the tiny test model's directory), in ember's own environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.runtimes.vllm import special_token


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> object:
    transformers = pytest.importorskip("transformers")
    from ember.testing.hf_models import tiny_llama_hf

    directory: Path = tiny_llama_hf(tmp_path_factory.mktemp("hf") / "tiny-llama")
    return transformers.AutoTokenizer.from_pretrained(directory)


def test_an_opening_spelled_in_ordinary_tokens_is_not_special(tokenizer: object) -> None:
    assert not special_token(tokenizer, "<tool_call>")   # several ordinary tokens in SmolLM2's vocabulary
    assert not special_token(tokenizer, "")              # a bare JSON call has no opening


def test_an_opening_the_tokenizer_holds_as_a_special_token_is_special(tokenizer: object) -> None:
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>"]})  # type: ignore[attr-defined]
    assert special_token(tokenizer, "<tool_call>")
    assert special_token(tokenizer, tokenizer.eos_token)  # type: ignore[attr-defined]
    assert not special_token(tokenizer, "Hello")
