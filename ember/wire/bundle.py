"""A bundle of named tensors as bytes: the one codec for the node's frames, the gateways' cluster bodies and the
job store's inputs and outputs.

A bundle is described by a list of tensor entries, `[{name, datatype, shape, nbytes}]`, in the order of their raw
bytes (`ember.wire.tensors.to_raw`: the V2 raw layout, never JSON lists). The node's frames carry the entries in
their own JSON header (`describe`, `read_tensors`); everywhere else a bundle stands alone (`pack`, `unpack`):

    u32 little-endian length of the entries' JSON | the entries (JSON, utf-8) | each tensor's raw bytes

Every decode checks what it was given and raises InvalidInput naming the tensor or the field (`what` says whose
bytes they were: "frame", "cluster body", "job").
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from ember.errors import InvalidInput
from ember.wire.tensors import Tensors, datatype_of, from_raw, to_raw

_LENGTH = struct.Struct("<I")


def describe(tensors: Mapping[str, np.ndarray]) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The entries of a bundle and the raw bytes of each tensor, in the same order (for vectored writes)."""
    entries, raws = [], []
    for name, array in tensors.items():
        raw = to_raw(array)
        entries.append({"name": name, "datatype": datatype_of(array), "shape": list(array.shape), "nbytes": len(raw)})
        raws.append(raw)
    return entries, raws


def read_tensors(entries: object, payload: bytes | bytearray | memoryview, what: str) -> Tensors:
    """The tensors `entries` describe, out of `payload` (which they must claim whole)."""
    if not isinstance(entries, list):
        raise InvalidInput(f"{what}: the tensor entries ('tensors') must be a list")
    view = memoryview(payload).cast("B")
    out: Tensors = {}
    pos = 0
    for i, entry in enumerate(entries):
        name, datatype, shape, nbytes = _entry(entry, i, what)
        if pos + nbytes > len(view):
            raise InvalidInput(f"{what}: tensor '{name}' needs {nbytes} bytes, {len(view) - pos} left")
        out[name] = from_raw(view[pos:pos + nbytes], datatype, shape, name)
        pos += nbytes
    if pos != len(view):
        raise InvalidInput(f"{what}: {len(view) - pos} bytes past the last tensor")
    return out


def pack(tensors: Mapping[str, np.ndarray]) -> bytes:
    """A standalone bundle (see the module docstring); `unpack` reads it back."""
    entries, raws = describe(tensors)
    head = json.dumps(entries).encode()   # byte for byte as the job store has always written them (its fingerprints)
    return b"".join((_LENGTH.pack(len(head)), head, *raws))


def unpack(blob: bytes | bytearray | memoryview, what: str) -> Tensors:
    view = memoryview(blob).cast("B")   # bytes, whatever the items of a view given
    if len(view) < _LENGTH.size:
        raise InvalidInput(f"{what}: {len(view)} bytes, too short for a tensor bundle")
    (n,) = _LENGTH.unpack_from(view, 0)
    if _LENGTH.size + n > len(view):
        raise InvalidInput(f"{what}: the tensor list claims {n} bytes, {len(view) - _LENGTH.size} follow")
    try:
        entries = json.loads(bytes(view[_LENGTH.size:_LENGTH.size + n]))
    except (UnicodeDecodeError, ValueError):
        raise InvalidInput(f"{what}: the tensor list is not JSON") from None
    return read_tensors(entries, view[_LENGTH.size + n:], what)


def _entry(entry: object, index: int, what: str) -> tuple[str, str, tuple[int, ...], int]:
    if not isinstance(entry, dict):
        raise InvalidInput(f"{what}: tensors[{index}] is not an object")
    name, datatype, shape, nbytes = (entry.get(k) for k in ("name", "datatype", "shape", "nbytes"))
    if not isinstance(name, str) or not isinstance(datatype, str):
        raise InvalidInput(f"{what}: tensors[{index}] needs string 'name' and 'datatype'")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise InvalidInput(f"{what}: tensor '{name}': 'shape' must be a list of sizes")
    if not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidInput(f"{what}: tensor '{name}': 'nbytes' must be a non-negative integer")
    return name, datatype, tuple(shape), nbytes
