"""LLM weights in the weight store: `ember store push model.gguf NAME` pushes the GGUF as it is; a contract with
`weights: store:NAME:VERSION` loads the file the store holds and answers as the file-backed model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ember.errors import ModelNotReady
from ember.runtimes.llm import LLMModel, LLMRuntime
from ember.store import WeightStore
from ember.store.config import StoreConfig
from ember.wire.contract import example_contracts_dir, load_contract, parse_contract

pytestmark = pytest.mark.slow


def request(question: str) -> dict[str, np.ndarray]:
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps({"messages": [{"role": "user", "content": question}], "temperature": 0,
                         "max_tokens": 12}).encode()
    return {"request": arr}


def text(model: LLMModel, question: str) -> str:
    return bytes(model.infer(request(question))["text"][0]).decode()


def push(root: Path, path: Path, name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ember", "store", "--root", str(root), "--no-memory", "--quiet",
                           "push", str(path), name], capture_output=True, text=True, timeout=300)


def test_a_pushed_gguf_loads_from_the_store_and_answers_the_same(smollm2: LLMModel, store_root: Path) -> None:
    gguf = smollm2.contract.weights_path()
    assert gguf is not None
    pushed = push(store_root, gguf, "smollm2-store:1")
    assert pushed.returncode == 0, pushed.stderr
    assert "pushed smollm2-store:1" in pushed.stdout
    data = smollm2.contract.model_dump(mode="json", exclude={"source"})
    data.update(name="smollm2-store", weights="store:smollm2-store:1")
    contract = parse_contract(data)
    store = WeightStore(StoreConfig.build(root=store_root, memory_dir=None))
    try:
        model = LLMRuntime(cache_root=None).load(contract, store=store)
    finally:
        store.close()
    assert model.store_root == store_root   # its snapshots go to the store it came from
    assert model.model_id == smollm2.model_id   # the same file: the same snapshots serve both
    held = Path(model.engine.path)          # type: ignore[attr-defined]
    assert held.suffix == ".gguf" and held.is_relative_to(store_root) and held.stat().st_size == gguf.stat().st_size
    assert len(model.decoder.cache) == 1    # its warmup prefix, computed and saved in that store
    question = "Name a large animal."
    expected = text(LLMModel(smollm2.contract, smollm2.engine, smollm2.options.model_copy(
        update={"prefix_cache_mb": 0}), smollm2.model_id), question)
    uncached = LLMModel(contract, model.engine, model.options.model_copy(update={"prefix_cache_mb": 0}),
                        model.model_id)
    assert text(uncached, question) == expected
    assert text(model, question)   # and through its own cache


def test_a_stored_model_without_a_gguf_is_not_ready(tmp_path: Path, store_root: Path) -> None:
    other = tmp_path / "weights.bin"
    other.write_bytes(b"not a model" * 100)
    assert push(store_root, other, "not-gguf:1").returncode == 0
    data = load_contract(example_contracts_dir() / "smollm2.yaml").model_dump(mode="json", exclude={"source"})
    data.update(name="not-gguf", weights="store:not-gguf:1")
    store = WeightStore(StoreConfig.build(root=store_root, memory_dir=None))
    try:
        with pytest.raises(ModelNotReady, match="the stored model holds no .gguf file"):
            LLMRuntime(cache_root=None).load(parse_contract(data), store=store)
    finally:
        store.close()
