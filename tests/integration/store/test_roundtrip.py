"""push -> (origin) -> pull -> tensors equal bit for bit; files byte for byte."""

from __future__ import annotations

import filecmp
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ember.errors import ModelNotFound
from ember.store import WeightStore, open_tensors
from ember.testing.checkpoints import mismatches
from ember.testing.nginx import NginxOrigin


def test_push_then_open_locally(make_store: Callable[..., WeightStore], checkpoint_dir: Path) -> None:
    store = make_store()
    manifest = store.push(checkpoint_dir, "tiny:1")
    assert manifest.key == "tiny:1"
    assert {f.path for f in manifest.files} == {"model.safetensors", "config.json", "tokenizer.json"}
    tensors = open_tensors("tiny:1", store=store)
    assert mismatches(load_file(checkpoint_dir / "model.safetensors"), dict(tensors.items())) == []


def test_round_trip_through_nginx_origin(
    make_store: Callable[..., WeightStore], checkpoint_dir: Path, minilm_dir: Path, nginx: NginxOrigin
) -> None:
    publisher = make_store("publisher", root=nginx.root, memory_dir=None)
    publisher.push(checkpoint_dir, "tiny:1")
    publisher.push(minilm_dir, "minilm:1")
    node = make_store("node", origin=nginx.url)
    assert node.models(remote=True) == ["minilm:1", "tiny:1"]
    for key, src in (("tiny:1", checkpoint_dir), ("minilm:1", minilm_dir)):
        node.pull(key)
        assert mismatches(load_file(src / "model.safetensors"), dict(open_tensors(key, store=node).items())) == []
        files = node.materialize(key, tensors=True)
        for f in node.manifest(key).files:
            assert filecmp.cmp(src / f.path, files / f.path, shallow=False), f.path
    # materialize without tensors: the runtime's directory of tokenizer/config files
    plain = node.materialize("minilm:1")
    assert (plain / "tokenizer.json").read_bytes() == (minilm_dir / "tokenizer.json").read_bytes()
    assert (plain / "1_Pooling" / "config.json").exists()
    assert not (plain / "model.safetensors").exists()


def test_unknown_model_names_the_model(make_store: Callable[..., WeightStore]) -> None:
    store = make_store()
    with pytest.raises(ModelNotFound, match="nope:2"):
        open_tensors("nope:2", store=store)


def test_to_device_copies_every_tensor(make_store: Callable[..., WeightStore], checkpoint_dir: Path) -> None:
    import torch

    store = make_store()
    store.push(checkpoint_dir, "tiny:1")
    tensors = open_tensors("tiny:1", store=store)
    moved = tensors.to_device("cpu")
    assert mismatches(load_file(checkpoint_dir / "model.safetensors"), moved) == []
    if not torch.cuda.is_available():
        from ember.errors import StoreError
        from ember.store.gpu import load_to_device

        with pytest.raises(StoreError, match="CUDA is not available"):
            load_to_device(tensors, torch.device("cuda"))


def test_writing_a_view_never_reaches_the_store(make_store: Callable[..., WeightStore], checkpoint_dir: Path) -> None:
    store = make_store()
    store.push(checkpoint_dir, "tiny:1")
    first = open_tensors("tiny:1", store=store)
    name = next(iter(first))
    first[name].zero_()  # copy-on-write: only this process's pages change
    again = open_tensors("tiny:1", store=store)
    assert mismatches(load_file(checkpoint_dir / "model.safetensors"), dict(again.items())) == []
    assert store.gc(verify=True).corrupt == 0
