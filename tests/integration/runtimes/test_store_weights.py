"""Runtimes loading `weights: store:NAME[:VERSION]` through a weight store (a local root, no origin)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ember.errors import ModelNotReady
from ember.node import procinfo
from ember.runtimes.embedding import EmbeddingRuntime
from ember.runtimes.python import PythonRuntime
from ember.store import StoreConfig, WeightStore
from ember.testing.models import minilm_dir
from ember.wire.contract import ModelContract, example_contracts_dir, load_contract, parse_contract

MINILM = load_contract(example_contracts_dir() / "minilm.yaml")
TEXT = np.array([b"A cat sits on the mat.", b"Weights from the store, views of its chunks."], dtype=object)


def with_weights(contract: ModelContract, weights: str, **extra: Any) -> ModelContract:
    return parse_contract({**contract.model_dump(exclude={"source"}), "weights": weights, **extra})


@pytest.fixture
def store(tmp_path: Path) -> Iterator[WeightStore]:
    with WeightStore(StoreConfig(root=tmp_path / "root", memory_dir=None)) as s:
        s.push(minilm_dir(), "minilm:1")
        yield s


def test_a_store_backed_minilm_embeds_exactly_like_the_bundled_one(store: WeightStore) -> None:
    model = EmbeddingRuntime().load(with_weights(MINILM, "store:minilm:1"), store=store)
    expected = EmbeddingRuntime().load(MINILM).infer({"text": TEXT})
    got = model.infer({"text": TEXT})
    np.testing.assert_array_equal(got["embedding"], expected["embedding"])
    np.testing.assert_array_equal(got["token_count"], expected["token_count"])
    # The tensors are views of the store's chunk files, not copies; the small files were materialized.
    chunks = str(store.root / "chunks")
    assert any(path.startswith(chunks) for _, _, path in procinfo.file_mappings())
    assert (store.root / "models" / "minilm" / "1" / "files" / "tokenizer.json").is_file()
    assert not (store.root / "models" / "minilm" / "1" / "files" / "model.safetensors").exists()


def test_store_errors_are_model_not_ready_naming_the_model_and_the_store(store: WeightStore, tmp_path: Path) -> None:
    with pytest.raises(ModelNotReady, match="none configured"):
        EmbeddingRuntime().load(with_weights(MINILM, "store:minilm:1"))
    with pytest.raises(ModelNotReady) as info:
        EmbeddingRuntime().load(with_weights(MINILM, "store:absent:2"), store=store)
    assert "model 'minilm:1'" in str(info.value) and "absent:2" in str(info.value)
    assert str(store.root) in str(info.value)
    no_tensors = tmp_path / "no-tensors"
    shutil.copytree(minilm_dir(), no_tensors, ignore=shutil.ignore_patterns("*.safetensors"))
    store.push(no_tensors, "hollow:1")
    with pytest.raises(ModelNotReady, match="no safetensors file 'model.safetensors'"):
        EmbeddingRuntime().load(with_weights(MINILM, "store:hollow:1"), store=store)


USER_MODEL = """
from pathlib import Path

import numpy as np


class Model:
    def load(self, weights, options):
        wanted = ("tokenizer.json", "config.json", "1_Pooling/config.json")
        self.found = sum((Path(weights) / name).is_file() for name in wanted)
        self.size = (Path(weights) / "model.safetensors").stat().st_size

    def infer(self, inputs):
        return {"y": np.array([self.size, self.found], dtype=np.int64)}
"""


def test_the_python_runtime_gets_the_materialized_directory_with_its_tensors(store: WeightStore,
                                                                            tmp_path: Path) -> None:
    (tmp_path / "user_store_model.py").write_text(USER_MODEL)
    contract = parse_contract({
        "name": "user", "runtime": "python", "entrypoint": "user_store_model:Model", "weights": "store:minilm:1",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "INT64", "shape": [2]}],
    }, source=str(tmp_path / "user.yaml"))
    model = PythonRuntime().load(contract, store=store)
    size, found = model.infer({"x": np.zeros(1, dtype=np.float32)})["y"].tolist()
    assert size == (minilm_dir() / "model.safetensors").stat().st_size
    assert found == 3
    with pytest.raises(ModelNotReady, match="none configured"):
        PythonRuntime().load(contract)
