"""Tensor-aligned chunking and safetensors header parsing."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from ember.errors import InvalidInput
from ember.store.chunking import plan_file
from ember.store.hashing import digest_file
from ember.testing.checkpoints import TensorSpec, write_checkpoint


def _spans(path: Path) -> dict[str, str]:
    plan = plan_file(path, 1 << 20)
    return {s.tensor: digest_file(path, s.start, s.size) for s in plan.spans if s.tensor}


def test_each_tensor_is_one_chunk_and_chunks_cover_the_file(tmp_path: Path) -> None:
    specs = [TensorSpec("a", (300, 7), "F16", 1), TensorSpec("b", (1024, 1024), "F32", 2),
             TensorSpec("c", (3,), "F16", 3)]
    path = write_checkpoint(tmp_path / "m.safetensors", specs)
    plan = plan_file(path, 1 << 20)
    assert plan.kind == "safetensors"
    assert [s.tensor for s in plan.spans if s.tensor] == ["a", "b", "c"]
    assert next(s for s in plan.spans if s.tensor == "b").size == 4 << 20  # one chunk even above the chunk size
    assert plan.spans[0].start == 0 and plan.spans[-1].end == path.stat().st_size
    assert all(x.end == y.start for x, y in zip(plan.spans, plan.spans[1:], strict=False))


def test_shared_tensor_gets_the_same_chunk_at_another_offset(tmp_path: Path) -> None:
    shared = TensorSpec("layer.w", (256, 256), "F16", 42)
    first = write_checkpoint(tmp_path / "a.safetensors", [TensorSpec("x", (10, 10), "F16", 1), shared])
    second = write_checkpoint(tmp_path / "b.safetensors", [TensorSpec("y", (77, 3), "F16", 2), shared])
    a, b = _spans(first), _spans(second)
    assert a["layer.w"] == b["layer.w"]
    assert a["x"] != b["y"]


def test_raw_files_are_cut_in_fixed_sizes(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(b"x" * 2500)
    plan = plan_file(path, 1000)
    assert plan.kind == "raw"
    assert [(s.start, s.end) for s in plan.spans] == [(0, 1000), (1000, 2000), (2000, 2500)]


def _header(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"\x01\x02", "too short"),
        (struct.pack("<Q", 10**12), "header length"),
        (struct.pack("<Q", 4) + b"nope", "not JSON"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (_header(b'{"t": {"a":1}}'), "lacks dtype"),
        (_header(b'{"t":{"dtype":"F16","shape":[4],"data_offsets":[0,8]}}'), "outside the file"),
    ],
)
def test_malformed_safetensors_is_refused_with_the_reason(tmp_path: Path, blob: bytes, message: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(InvalidInput, match=message):
        plan_file(path, 1 << 20)
