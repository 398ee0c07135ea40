"""Model names, manifests and store configuration: validated, with errors that name the field."""

from __future__ import annotations

import json

import pytest

from ember.errors import InvalidInput, StoreError
from ember.store import Manifest, ModelRef, StoreConfig
from ember.store.manifest import Chunk, FileEntry, TensorEntry

D = "ab" * 32


def test_model_ref_parses_name_and_version() -> None:
    assert ModelRef.parse("minilm:1").key == "minilm:1"
    assert ModelRef.parse("minilm").version == "latest"
    assert ModelRef.parse("a.b-c_d:v2.0").manifest_path == "manifests/a.b-c_d/v2.0.json"


@pytest.mark.parametrize(("text", "field"), [("", "name"), ("../x:1", "name"), ("m:../../etc", "version"),
                                              ("m:a/b", "version"), ("x" * 200, "name")])
def test_bad_model_names_name_the_part(text: str, field: str) -> None:
    with pytest.raises(InvalidInput, match=field):
        ModelRef.parse(text)


def _manifest(order: tuple[str, ...] = ()) -> Manifest:
    tensors = {"w": TensorEntry(dtype="F16", shape=(2, 2), chunk=1),
               "e": TensorEntry(dtype="F32", shape=(0,), chunk=None)}
    chunks = (Chunk(digest=D, size=16), Chunk(digest="cd" * 32, size=8))
    files = (FileEntry(path="model.safetensors", size=24, kind="safetensors", chunks=chunks, tensors=tensors),)
    return Manifest(name="m", version="1", files=files, load_order=order)


def test_manifest_round_trips_through_json() -> None:
    m = _manifest(("e", "w"))
    again = Manifest.from_json(m.to_json(), "test")
    assert again == m
    assert again.ordered_tensors() == ["e", "w"]
    assert _manifest().ordered_tensors() == ["w", "e"]
    assert m.tensor_chunks()["w"] == Chunk(digest="cd" * 32, size=8)
    assert m.logical_bytes == 24


@pytest.mark.parametrize(("data", "message"), [(b"{", "not valid"), (b"[]", "not valid"),
                                               (b'{"format": 99}', "format 99"), (b'{"format": 1}', "not valid")])
def test_bad_manifest_is_a_store_error(data: bytes, message: str) -> None:
    with pytest.raises(StoreError, match=message):
        Manifest.from_json(data, "where")


@pytest.mark.parametrize(("values", "key"), [({"memory_capacity": -1}, "memory_capacity"),
                                             ({"threads": 0}, "threads"), ({"origin": "ftp://x"}, "origin"),
                                             ({"part_size": 10}, "part_size"), ({"colour": 1}, "colour")])
def test_store_config_errors_name_the_key(values: dict[str, object], key: str) -> None:
    with pytest.raises(InvalidInput, match=f"store config: {key}"):
        StoreConfig.build(**values)


def test_store_config_normalises_the_origin() -> None:
    assert StoreConfig.build(origin="http://h:1/root").origin == "http://h:1/root/"
    assert not StoreConfig.build(memory_dir=None).memory_enabled


def test_each_root_gets_its_own_memory_tier_by_default() -> None:
    a, b = StoreConfig.build(root="/srv/a"), StoreConfig.build(root="/srv/b")
    if a.memory_dir is None:  # no /dev/shm on this machine
        return
    assert a.memory_dir != b.memory_dir
    assert StoreConfig.build(root="/srv/a").memory_dir == a.memory_dir
    assert StoreConfig.build(root="/srv/a", memory_dir=None).memory_dir is None


@pytest.mark.parametrize("path", ["/etc/cron.d/x", "../x", "a/../../x", "a//b", "./x", "a/", ""])
def test_a_manifest_naming_a_file_outside_its_directory_is_refused(path: str) -> None:
    """A manifest may come from a peer (a process image's): materializing it must not write outside the model."""
    raw = _manifest().model_dump(mode="json")
    raw["files"][0]["path"] = path
    with pytest.raises(StoreError, match="must be relative"):
        Manifest.from_json(json.dumps(raw), "peer")
