"""Cutting files into chunks: one chunk per tensor for safetensors, fixed-size chunks for anything else.

Tensor-aligned chunks make a tensor's bytes one chunk wherever it sits in its file, so a fine-tune that
shares tensors with its base shares their chunks even when the offsets differ, and every tensor can be
mapped as one contiguous view of one chunk file.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ember.errors import InvalidInput

# A header larger than this is not a safetensors file we accept (the format caps it at 100 MB).
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class Span:
    """Bytes [start, end) of a file that become one chunk; `tensor` names the tensor they hold, if any."""

    start: int
    end: int
    tensor: str | None = None

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offsets in the file
    end: int


@dataclass(frozen=True)
class FilePlan:
    kind: Literal["safetensors", "raw"]
    size: int
    spans: tuple[Span, ...]
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None


def read_safetensors_header(path: Path) -> tuple[int, dict[str, TensorInfo], dict[str, str] | None]:
    """(header length incl. the 8-byte prefix, tensors with absolute offsets, metadata); InvalidInput if malformed."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise InvalidInput(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", prefix)
        if n > _MAX_HEADER or 8 + n > size:
            raise InvalidInput(f"{path}: safetensors header length {n} is out of range")
        try:
            header = json.loads(f.read(n))
        except ValueError as err:
            raise InvalidInput(f"{path}: safetensors header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise InvalidInput(f"{path}: safetensors header is not a JSON object")
    base = 8 + n
    metadata = header.pop("__metadata__", None)
    tensors: dict[str, TensorInfo] = {}
    for name, info in header.items():
        try:
            begin, stop = (int(x) for x in info["data_offsets"])
            shape = tuple(int(d) for d in info["shape"])
            tensors[name] = TensorInfo(str(info["dtype"]), shape, base + begin, base + stop)
        except (KeyError, TypeError, ValueError):
            raise InvalidInput(f"{path}: tensor {name!r} lacks dtype, shape or data_offsets") from None
        if not base <= tensors[name].start <= tensors[name].end <= size:
            raise InvalidInput(f"{path}: tensor {name!r} data_offsets lie outside the file")
    return base, tensors, metadata


def plan_file(path: Path, file_chunk_size: int) -> FilePlan:
    """How `path` is cut: safetensors (by name and a valid header) per tensor, anything else in fixed sizes."""
    size = path.stat().st_size
    if path.suffix == ".safetensors":
        base, tensors, metadata = read_safetensors_header(path)
        return FilePlan("safetensors", size, _tensor_spans(base, size, tensors, file_chunk_size), tensors, metadata)
    return FilePlan("raw", size, tuple(_fixed(0, size, file_chunk_size)), {}, None)


def _tensor_spans(base: int, size: int, tensors: dict[str, TensorInfo], gap_chunk: int) -> tuple[Span, ...]:
    spans = list(_fixed(0, base, gap_chunk))
    at = base
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if t.start == t.end:
            continue
        if t.start < at:
            raise InvalidInput(f"tensor {name!r} overlaps another tensor")
        spans.extend(_fixed(at, t.start, gap_chunk))  # bytes between tensors (the format allows none, but keep them)
        spans.append(Span(t.start, t.end, name))
        at = t.end
    spans.extend(_fixed(at, size, gap_chunk))
    return tuple(spans)


def _fixed(start: int, end: int, step: int) -> list[Span]:
    return [Span(s, min(s + step, end)) for s in range(start, end, step)]
