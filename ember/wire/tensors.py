"""Tensors as numpy arrays, the V2 datatypes they map to, and their raw-byte encoding.

Inside ember a batch of named tensors is `Tensors = dict[str, np.ndarray]`. BYTES
tensors are numpy object arrays of `bytes`. On the wire (the V2 binary extension and
the gateway <-> instance framing) fixed-size tensors travel as their raw little-endian
bytes and BYTES tensors as a sequence of 4-byte little-endian lengths each followed by
that many bytes, exactly as in the KServe V2 binary tensor extension.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping

import numpy as np

from ember.errors import InvalidInput, OutputMismatch
from ember.wire.contract import ModelContract, TensorSpec, warmup_shape

Tensors = dict[str, np.ndarray]

NUMPY_OF: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"), "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
}


def datatype_of(array: np.ndarray) -> str:
    """The V2 datatype name of a numpy array."""
    if array.dtype == object or array.dtype.kind in ("S", "U"):
        return "BYTES"
    little = array.dtype.newbyteorder("<")
    for name, dtype in NUMPY_OF.items():
        if name != "BYTES" and little == dtype:
            return name
    raise InvalidInput(f"unsupported tensor dtype {array.dtype}")


def encode_bytes_elements(array: np.ndarray) -> bytes:
    """BYTES tensor -> length-prefixed bytes (V2 binary layout), row-major."""
    out = bytearray()
    for item in array.reshape(-1):
        raw = item.encode() if isinstance(item, str) else bytes(item)
        out += struct.pack("<I", len(raw))
        out += raw
    return bytes(out)


def decode_bytes_elements(buf: bytes | memoryview, shape: tuple[int, ...], name: str) -> np.ndarray:
    """Length-prefixed bytes -> BYTES tensor of `shape`; errors name the tensor."""
    view = memoryview(buf)
    items: list[bytes] = []
    pos = 0
    while pos < len(view):
        if pos + 4 > len(view):
            raise InvalidInput(f"input '{name}': truncated BYTES element length")
        (n,) = struct.unpack_from("<I", view, pos)
        pos += 4
        if pos + n > len(view):
            raise InvalidInput(f"input '{name}': BYTES element overruns the buffer")
        items.append(bytes(view[pos : pos + n]))
        pos += n
    count = math.prod(shape)  # exact: numpy's int64 product wraps for huge shapes
    if len(items) != count:
        raise InvalidInput(f"input '{name}': shape {list(shape)} needs {count} elements, got {len(items)}")
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    return arr.reshape(shape)


def to_raw(array: np.ndarray) -> bytes:
    """A tensor's raw wire bytes (see module docstring)."""
    if datatype_of(array) == "BYTES":
        return encode_bytes_elements(array)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


# numpy takes at most 64 axes, and refuses an array whose non-zero axes multiply past its index range even when
# another axis is 0 (then it holds nothing): such shapes are refused here, by name, before numpy sees them.
MAX_DIMS = 16
MAX_EXTENT = 2**48


def check_shape(shape: tuple[int, ...] | list[int], name: str) -> tuple[int, ...]:
    """A request's tensor shape, checked before any array is made of it; errors name the input."""
    if len(shape) > MAX_DIMS:
        raise InvalidInput(f"input '{name}': shape has {len(shape)} dimensions, at most {MAX_DIMS}")
    if any(d < 0 for d in shape):
        raise InvalidInput(f"input '{name}': shape {list(shape)} has a negative dimension")
    if math.prod(max(d, 1) for d in shape) > MAX_EXTENT:
        raise InvalidInput(f"input '{name}': shape {list(shape)} is too large")
    return tuple(shape)


def from_raw(buf: bytes | memoryview, datatype: str, shape: tuple[int, ...], name: str) -> np.ndarray:
    """Raw wire bytes -> tensor; errors name the tensor and say what was expected."""
    if datatype not in NUMPY_OF:
        raise InvalidInput(f"input '{name}': unknown datatype {datatype!r}")
    check_shape(shape, name)
    if datatype == "BYTES":
        return decode_bytes_elements(buf, shape, name)
    dtype = NUMPY_OF[datatype]
    count = math.prod(shape)
    if len(buf) != count * dtype.itemsize:
        raise InvalidInput(
            f"input '{name}': {len(buf)} bytes do not hold shape {list(shape)} of {datatype}"
        )
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def _shape_matches(spec: TensorSpec, shape: tuple[int, ...]) -> bool:
    return len(spec.shape) == len(shape) and all(s in (-1, d) for s, d in zip(spec.shape, shape, strict=True))


def validate_inputs(contract: ModelContract, inputs: Mapping[str, np.ndarray]) -> None:
    """Check names, datatypes and shapes against the contract; errors name the input."""
    for name in inputs:
        if contract.input(name) is None:
            expected = ", ".join(t.name for t in contract.inputs)
            raise InvalidInput(f"input '{name}': model '{contract.name}' has no such input (expects {expected})")
    for spec in contract.inputs:
        if spec.name not in inputs:
            raise InvalidInput(f"input '{spec.name}': missing (model '{contract.name}' requires it)")
        array = inputs[spec.name]
        got = datatype_of(array)
        if got != spec.datatype:
            raise InvalidInput(f"input '{spec.name}': datatype {got} does not match the contract's {spec.datatype}")
        if not _shape_matches(spec, tuple(array.shape)):
            raise InvalidInput(
                f"input '{spec.name}': shape {list(array.shape)} does not match the contract's {list(spec.shape)}"
            )
        _check_cost(contract, spec.name, array)


def _check_cost(contract: ModelContract, name: str, array: np.ndarray) -> None:
    """The contract's `limits` on one input: rows per request, bytes per string."""
    limits = contract.limits
    if array.ndim and array.shape[0] > limits.max_batch_rows:
        raise InvalidInput(f"input '{name}': {array.shape[0]} rows exceed the limit of {limits.max_batch_rows} "
                           f"per request (limits.max_batch_rows of model '{contract.name}')")
    if array.dtype == object and array.size:
        longest = max(len(item) for item in array.reshape(-1))
        if longest > limits.max_string_bytes:
            raise InvalidInput(string_too_long(contract, name, longest))


def string_too_long(contract: ModelContract, name: str, size: int, at_least: bool = False) -> str:
    """The refusal of an element of input `name` with `size` bytes (`at_least`: counted before it is encoded) past
    the contract's `limits.max_string_bytes`: the node's, and the gateway's on the text it would become."""
    return (f"input '{name}': an element of {'at least ' if at_least else ''}{size} bytes exceeds the limit of "
            f"{contract.limits.max_string_bytes} (limits.max_string_bytes of model '{contract.name}'); send less text")


def check_outputs(contract: ModelContract, outputs: Mapping[str, np.ndarray]) -> None:
    """The model's reply against the contract's outputs; OutputMismatch naming the output (run on the warm-up,
    where it fails the start, so that a contract that does not describe its model fails once, with the reason)."""
    where = f"model '{contract.key}': outputs"
    declared = {spec.name: spec for spec in contract.outputs}
    for name in outputs:
        if name not in declared:
            raise OutputMismatch(f"{where}: the model returns '{name}', which the contract does not declare "
                                  f"(it declares {', '.join(declared)})")
    for name, spec in declared.items():
        if name not in outputs:
            raise OutputMismatch(f"{where}.{name}: declared, but the model's reply has no such output")
        array = np.asarray(outputs[name])
        got = datatype_of(array)
        if got != spec.datatype or not _shape_matches(spec, tuple(array.shape)):
            raise OutputMismatch(f"{where}.{name}: the contract declares {spec.datatype} {list(spec.shape)}, "
                                  f"the model returned {got} {list(array.shape)}")


def warmup_inputs(contract: ModelContract) -> Tensors:
    """The contract's warmup request: its `warmup.inputs` values where it gives them, else dummies built from
    the contract (-1 axes become 1, BYTES get a short sentence, numbers are zeros)."""
    out: Tensors = {}
    given = contract.warmup.inputs or {}
    for spec in contract.inputs:
        if spec.name in given:
            values = given[spec.name]
            shape = warmup_shape(spec, len(values))
            assert shape is not None   # checked when the contract was parsed
            if spec.datatype == "BYTES":
                arr = np.empty(len(values), dtype=object)
                arr[:] = [str(v).encode() for v in values]
                out[spec.name] = arr.reshape(shape)
            else:
                out[spec.name] = np.asarray(values, dtype=NUMPY_OF[spec.datatype]).reshape(shape)
            continue
        shape = tuple(1 if d == -1 else d for d in spec.shape)
        if spec.datatype == "BYTES":
            arr = np.empty(shape, dtype=object)
            arr.reshape(-1)[:] = [b"ember warms up this model."] * int(np.prod(shape))
            out[spec.name] = arr
        else:
            out[spec.name] = np.zeros(shape, dtype=NUMPY_OF[spec.datatype])
    return out
