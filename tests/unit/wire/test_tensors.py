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


def with_warmup(inputs: dict) -> object:
    return parse_contract({**C.model_dump(mode="json", exclude={"source"}), "warmup": {"inputs": inputs}})


def test_warmup_inputs_use_the_contracts_values_where_it_gives_them() -> None:
    contract = with_warmup({"text": ['{"prompt": "hi"}', "b"], "w": [1, 2, 3, 4, 5, 6]})
    inputs = warmup_inputs(contract)  # type: ignore[arg-type]
    validate_inputs(contract, inputs)  # type: ignore[arg-type]
    assert inputs["text"].tolist() == [b'{"prompt": "hi"}', b"b"]
    assert inputs["w"].dtype == np.float32 and inputs["w"].tolist() == [[1, 2, 3], [4, 5, 6]]
    only_text = warmup_inputs(with_warmup({"text": ["x"]}))  # type: ignore[arg-type]
    assert only_text["w"].shape == (2, 1) and not only_text["w"].any()   # not given: the dummy


@pytest.mark.parametrize(("inputs", "message"), [
    ({"nope": ["x"]}, "warmup.inputs: 'nope' is not an input"),
    ({"text": [1]}, "warmup.inputs.text: a BYTES input's values are strings"),
    ({"w": ["1"]}, "warmup.inputs.w: a FP32 input's values are numbers"),
    ({"w": [1, 2, 3]}, r"warmup.inputs.w: 3 values do not fill shape \[2, -1\]"),
    ({"text": []}, r"warmup.inputs.text: 0 values do not fill shape \[-1\]"),
])
def test_warmup_values_that_do_not_fit_the_contract_are_refused(inputs: dict, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        with_warmup(inputs)


@pytest.mark.parametrize(("shape", "message"), [
    ((0, 10**19), r"input 'a': shape \[0, 10000000000000000000\] is too large"),
    ((0,) * 65, r"input 'a': shape has 65 dimensions, at most 16"),
    ((2, -3), r"input 'a': shape \[2, -3\] has a negative dimension"),
])
def test_shapes_numpy_cannot_hold_are_refused_naming_the_tensor(shape: tuple[int, ...], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        from_raw(b"", "FP32", shape, "a")


LIMITED = parse_contract({
    "name": "m", "runtime": "python", "entrypoint": "a:B",
    "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    "limits": {"max_batch_rows": 3, "max_string_bytes": 5},
})


def _texts(*items: bytes) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = list(items)
    return arr


def test_the_contracts_limits_cap_rows_and_string_bytes_naming_the_input_and_the_key() -> None:
    validate_inputs(LIMITED, {"text": _texts(b"abcde", b"", b"x")})
    with pytest.raises(InvalidInput, match=r"^input 'text': 4 rows exceed the limit of 3 per request "
                                           r"\(limits.max_batch_rows of model 'm'\)"):
        validate_inputs(LIMITED, {"text": _texts(*[b"a"] * 4)})
    with pytest.raises(InvalidInput, match=r"^input 'text': an element of 6 bytes exceeds the limit of 5 "
                                           r"\(limits.max_string_bytes"):
        validate_inputs(LIMITED, {"text": _texts(b"a", b"abcdef")})


def test_the_bundled_examples_fit_the_default_limits() -> None:
    from ember.wire.contract import example_contracts_dir, find_contracts, load_contract

    for path in find_contracts(example_contracts_dir()):
        contract = load_contract(path)
        validate_inputs(contract, warmup_inputs(contract))
        assert contract.limits.max_batch_rows >= contract.max_batch_size
