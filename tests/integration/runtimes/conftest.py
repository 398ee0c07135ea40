"""The llm runtime's models for its integration tests: the bundled SmolLM2 (loaded once per session) and tiny
random-weight GGUFs of every architecture ember.testing.gguf_models writes (written once per session)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ember.runtimes.llm import LLMModel, LLMRuntime
from ember.wire.contract import example_contracts_dir, load_contract, parse_contract

SMOLLM2 = load_contract(example_contracts_dir() / "smollm2.yaml")


@pytest.fixture(scope="session")
def smollm2(llm_store: Path) -> Iterator[LLMModel]:
    contract = SMOLLM2
    started = time.perf_counter()
    loaded = LLMRuntime(cache_root=llm_store).load(contract)   # maps the GGUF; computes and saves the warmup prefix
    first = time.perf_counter() - started
    started = time.perf_counter()
    again = LLMRuntime(cache_root=llm_store).load(contract)    # maps it again; restores the prefix's snapshot
    second = time.perf_counter() - started
    print(f"\nllm: first load {first:.2f} s, second load {second:.2f} s (mapped, its warmup prefix restored)")
    assert len(again.decoder.cache) == 1 and again.decoder.cache.covers(again.declared_prefixes()[0])
    assert again.model_id == loaded.model_id
    yield loaded   # llm_store's own teardown removes its memory tier


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_gguf(arch)`: a tiny random-weight GGUF of `arch` (2 layers, width 64, context 2048, SmolLM2's
    vocabulary), written on first use."""
    from ember.testing.gguf_models import write_model

    where = tmp_path_factory.mktemp("tiny-gguf")
    written: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in written:
            written[arch] = write_model(where / f"tiny-{arch}.gguf", arch)
        return written[arch]

    return get


@pytest.fixture
def tiny_model(tiny_gguf: Callable[[str], Path], store_root: Path) -> Callable[..., LLMModel]:
    """`tiny_model(arch, **options)`: a tiny GGUF loaded through LLMRuntime with a contract like SmolLM2's
    (weights: its absolute path); its context is the file's (2048), no snapshots unless asked."""
    def load(arch: str, **options: Any) -> LLMModel:
        options = {"kv_tokens": None, "snapshots": False, **options}
        data = SMOLLM2.model_dump(mode="json", exclude={"source"})
        data.update(name=f"tiny-{arch}", weights=str(tiny_gguf(arch)), options={**data["options"], **options})
        return LLMRuntime(cache_root=store_root).load(parse_contract(data))

    return load
