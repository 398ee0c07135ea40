"""A tensor bundle (`ember.wire.bundle`), the one codec of tensors as bytes: what goes in comes back, bytes and
all; whatever bytes come in, a decode either gives tensors or raises InvalidInput naming the fault."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.errors import InvalidInput
from ember.wire import bundle

DTYPES = (np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8, np.bool_)


@st.composite
def tensor_sets(draw: st.DrawFn) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name in draw(st.lists(st.text("abcxyz_", min_size=1, max_size=6), unique=True, max_size=4)):
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
        if draw(st.booleans()):
            size = int(np.prod(shape))
            out[name] = np.array([draw(st.binary(max_size=5)) for _ in range(size)], dtype=object).reshape(shape)
        else:
            out[name] = np.arange(int(np.prod(shape))).astype(draw(st.sampled_from(DTYPES))).reshape(shape)
    return out


@given(tensor_sets())
def test_a_bundle_comes_back_as_it_went_in(tensors: dict[str, np.ndarray]) -> None:
    back = bundle.unpack(bundle.pack(tensors), "job")
    assert list(back) == list(tensors)
    for name, array in tensors.items():
        assert back[name].shape == array.shape and back[name].tolist() == array.tolist()


def test_the_job_stores_bytes_are_what_they_always_were() -> None:
    """Jobs written before the codec was shared read back, and their idempotency fingerprints stay the same."""
    blob = bundle.pack({"x": np.array([1, 2], np.int32)})
    head = b'[{"name": "x", "datatype": "INT32", "shape": [2], "nbytes": 8}]'
    assert blob == len(head).to_bytes(4, "little") + head + b"\1\0\0\0\2\0\0\0"


@pytest.mark.parametrize(
    ("entries", "payload", "message"),
    [
        ([{"name": "x", "datatype": "FP32", "shape": [4], "nbytes": 16}], b"\0" * 8, "needs 16 bytes"),
        ([{"name": "x", "datatype": "FP32", "shape": [1], "nbytes": 4}], b"\0" * 6, "past the last tensor"),
        ([{"name": "x", "datatype": "FP32", "shape": [3], "nbytes": 4}], b"\0" * 4, "input 'x'"),
        ([{"name": "x", "datatype": "FP99", "shape": [1], "nbytes": 4}], b"\0" * 4, "datatype"),
        ([{"name": "x", "datatype": "FP32", "shape": "4", "nbytes": 16}], b"", "'shape'"),
        ([{"name": "x", "datatype": "FP32", "shape": [4]}], b"", "'nbytes'"),
        (["x"], b"", r"frame: tensors\[0\]"),
        ({}, b"", "must be a list"),
    ],
)
def test_bad_tensor_entries_are_named(entries: object, payload: bytes, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        bundle.read_tensors(entries, payload, "frame")


@pytest.mark.parametrize(("blob", "says"), [(b"", "too short"), (b"\xff\0\0\0[]", "claims 255 bytes"),
                                            (b"\2\0\0\0{]", "not JSON"), (b"\2\0\0\0[]extra", "past the last"),
                                            (b'\2\0\0\0""', "must be a list")])
def test_a_malformed_bundle_is_invalid_input_naming_the_fault(blob: bytes, says: str) -> None:
    with pytest.raises(InvalidInput, match=f"cluster body: .*{says}"):
        bundle.unpack(blob, "cluster body")


@settings(max_examples=300)
@given(st.binary(max_size=200), st.integers(0, 120))
def test_any_bytes_decode_or_raise_invalid_input(noise: bytes, cut: int) -> None:
    real = bundle.pack({"x": np.arange(6, dtype=np.float32), "s": np.array([b"ab", b""], dtype=object)})
    for blob in (noise, real[:cut] + noise[:8], real[:4] + noise):
        with contextlib.suppress(InvalidInput):
            bundle.unpack(blob, "job")
