"""The bundled SmolLM2, loaded once per session for the llm runtime's tests."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ember.runtimes.llm import LLMModel, LLMRuntime
from ember.wire.contract import example_contracts_dir, load_contract


@pytest.fixture(scope="session")
def smollm2(llm_store: Path) -> LLMModel:
    contract = load_contract(example_contracts_dir() / "smollm2.yaml")
    started = time.perf_counter()
    loaded = LLMRuntime(cache_root=llm_store).load(contract)
    first = time.perf_counter() - started
    started = time.perf_counter()
    again = LLMRuntime(cache_root=llm_store).load(contract)
    cached = time.perf_counter() - started
    print(f"\nllm: first load {first:.1f} s (converts unless cached), cached load {cached:.2f} s")
    assert again.root == loaded.root   # the second load found the conversion
    return loaded
