from __future__ import annotations

import numpy as np
import pytest

from ember.errors import InvalidInput
from ember.wire.contract import parse_contract
from ember.wire.tensors import datatype_of, from_raw, to_raw, validate_inputs, warmup_inputs

C = parse_contract({
    "name": "m", "runtime": "python", "entrypoint": "a:B",
    "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]},
               {"name": "w", "datatype": "FP32", "shape": [2, -1]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
})


def test_raw_round_trip_numeric_and_bytes() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert np.array_equal(from_raw(to_raw(a), "FP32", (2, 3), "a"), a)
    b = np.array([b"hello", "w\u00f6rld".encode(), b""], dtype=object)
    assert list(from_raw(to_raw(b), "BYTES", (3,), "b")) == list(b)


def test_datatypes() -> None:
    assert datatype_of(np.zeros(1, np.int64)) == "INT64"
    assert datatype_of(np.zeros(1, ">f4")) == "FP32"
    assert datatype_of(np.array(["a"])) == "BYTES"


def test_raw_size_mismatch_names_the_tensor() -> None:
    with pytest.raises(InvalidInput, match="input 'a'"):
        from_raw(b"\x00" * 7, "FP32", (2,), "a")
    with pytest.raises(InvalidInput, match="input 'b'"):
        from_raw(b"\x05\x00\x00\x00ab", "BYTES", (1,), "b")


@pytest.mark.parametrize("datatype", ["FP32", "BYTES"])
def test_a_shape_whose_element_count_overflows_int64_is_refused_naming_the_tensor(datatype: str) -> None:
    with pytest.raises(InvalidInput, match=r"input 'a': .*\[4294967296, 4294967296\]"):
        from_raw(b"", datatype, (2**32, 2**32), "a")
    with pytest.raises(InvalidInput, match="input 'a': shape \\[-1, -2\\] has a negative dimension"):
        from_raw(b"\x00" * 8, datatype, (-1, -2), "a")


def test_validate_inputs_names_the_input() -> None:
    good = {"text": np.array([b"x"], dtype=object), "w": np.zeros((2, 5), np.float32)}
    validate_inputs(C, good)
    with pytest.raises(InvalidInput, match="input 'w': datatype FP64"):
        validate_inputs(C, {**good, "w": np.zeros((2, 5))})
    with pytest.raises(InvalidInput, match="input 'w': shape \\[3, 5\\]"):
        validate_inputs(C, {**good, "w": np.zeros((3, 5), np.float32)})
    with pytest.raises(InvalidInput, match="input 'text': missing"):
        validate_inputs(C, {"w": good["w"]})
    with pytest.raises(InvalidInput, match="input 'z': model 'm' has no such input"):
        validate_inputs(C, {**good, "z": good["w"]})


def test_warmup_inputs_satisfy_the_contract() -> None:
    validate_inputs(C, warmup_inputs(C))
