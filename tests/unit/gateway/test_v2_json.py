"""V2 JSON responses: numeric outputs written straight from numpy, exact for their own type."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ember.gateway.v2_codec import ParsedInfer, dumps, encode_infer_response, json_output
from ember.wire.contract import example_contracts_dir, load_contract


def test_float32_outputs_read_back_to_the_same_float32_and_stay_short() -> None:
    values = np.random.default_rng(7).standard_normal(384).astype(np.float32)
    body = dumps({"outputs": [json_output("embedding", values.reshape(1, 384), numbers_as_array=True)]})
    out = json.loads(body)["outputs"][0]
    assert out["shape"] == [1, 384] and out["datatype"] == "FP32"
    assert np.array_equal(np.asarray(out["data"], dtype=np.float32), values)
    assert len(body) < len(json.dumps(values.tolist()))   # float32's shortest text, not float64's


@pytest.mark.parametrize("array", [
    np.array([[1, -2], [3, 4]], dtype=np.int64),
    np.array([0.5, 2.0], dtype=np.float16),
    np.array([True, False]),
    np.array([1.5, -2.25], dtype=">f4"),                      # not native-endian: the fallback writes it
    np.arange(12, dtype=np.uint16).reshape(3, 4)[:, :1],      # a non-contiguous view: likewise
])
def test_every_numeric_output_matches_the_standard_library_encoding(array: np.ndarray) -> None:
    fast = json.loads(dumps(json_output("y", array, numbers_as_array=True)))
    assert fast == json_output("y", array)


def test_non_finite_outputs_keep_nan_and_infinity_as_before() -> None:
    contract = load_contract(example_contracts_dir() / "iris.yaml")
    parsed = ParsedInfer(request_id=None, inputs={}, outputs=None, binary_default=False)
    outputs = {"probabilities": np.array([[np.nan, np.inf, -np.inf]], dtype=np.float32),
               "label": np.array([1], dtype=np.int64)}
    body, header_length = encode_infer_response(contract, parsed, outputs)
    assert header_length is None
    data = json.loads(body)["outputs"][0]["data"]    # Python's json reads NaN/Infinity, as tritonclient does
    assert np.isnan(data[0]) and data[1:] == [float("inf"), float("-inf")]
