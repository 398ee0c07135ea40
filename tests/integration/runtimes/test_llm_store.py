"""LLM weights in the weight store: `ember store push model.gguf NAME` converts and pushes; a contract with
`weights: store:NAME` loads the tensors as views of the store's chunks and answers as the file-backed model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ember.runtimes.llm import LLMModel, LLMRuntime
from ember.store import WeightStore
from ember.store.config import StoreConfig
from ember.wire.contract import parse_contract

pytestmark = pytest.mark.slow


def test_a_pushed_gguf_loads_from_the_store_and_answers_the_same(smollm2: LLMModel, llm_store: Path) -> None:
    gguf = smollm2.contract.weights_path()
    assert gguf is not None
    pushed = subprocess.run([sys.executable, "-m", "ember", "store", "--root", str(llm_store), "--no-memory",
                             "--quiet", "push", str(gguf), "smollm2-store:1"],
                            capture_output=True, text=True, timeout=600)
    assert pushed.returncode == 0, pushed.stderr
    assert "pushed smollm2-store:1" in pushed.stdout
    data = smollm2.contract.model_dump(mode="json", exclude={"source"})
    data.update(name="smollm2-store", weights="store:smollm2-store:1")
    contract = parse_contract(data)
    store = WeightStore(StoreConfig.build(root=llm_store, memory_dir=None))
    try:
        model = LLMRuntime(cache_root=llm_store).load(contract, store=store)
    finally:
        store.close()
    assert model.model_id == smollm2.model_id   # same conversion: the same snapshots serve both
    assert str(model.root).startswith(str(llm_store / "models"))
    assert model.model.model.embed_tokens.weight.data_ptr() != smollm2.model.model.embed_tokens.weight.data_ptr()
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                         "temperature": 0, "max_tokens": 12}).encode()
    assert bytes(model.infer({"request": arr})["text"][0]) == bytes(smollm2.infer({"request": arr})["text"][0])
