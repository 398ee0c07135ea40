"""A model's reply against its contract's outputs: each mismatch names the output and both sides."""

from __future__ import annotations

import numpy as np
import pytest

from ember.errors import OutputMismatch
from ember.wire.contract import parse_contract
from ember.wire.tensors import check_outputs

CONTRACT = parse_contract({
    "name": "m", "runtime": "python", "entrypoint": "x:Y",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}],
    "outputs": [{"name": "y", "datatype": "FP64", "shape": [-1, 3]}, {"name": "n", "datatype": "INT64", "shape": [1]}],
})
GOOD = {"y": np.zeros((2, 3)), "n": np.array([1], np.int64)}


def test_a_matching_reply_passes() -> None:
    check_outputs(CONTRACT, GOOD)


@pytest.mark.parametrize(("reply", "message"), [
    ({**GOOD, "y": np.zeros((2, 3), np.float32)}, r"outputs.y: the contract declares FP64 \[-1, 3\], the model "
                                                   r"returned FP32 \[2, 3\]"),
    ({**GOOD, "y": np.zeros((2, 2))}, r"outputs.y: .* returned FP64 \[2, 2\]"),
    ({"y": GOOD["y"]}, "outputs.n: declared, but the model's reply has no such output"),
    ({**GOOD, "extra": np.zeros(1)}, "the model returns 'extra', which the contract does not declare"),
])
def test_mismatches_name_the_output(reply: dict[str, np.ndarray], message: str) -> None:
    with pytest.raises(OutputMismatch, match=message):
        check_outputs(CONTRACT, reply)
