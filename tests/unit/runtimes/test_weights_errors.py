"""Every runtime reports weights it cannot resolve once, naming the model and the key (no "weights: weights:")."""

from __future__ import annotations

import pytest

from ember.errors import ModelNotReady
from ember.runtimes import get_runtime
from ember.wire.contract import example_contracts_dir, load_contract, parse_contract


@pytest.mark.parametrize("example", ["minilm", "smollm2", "iris"])
def test_a_package_that_is_not_installed_is_named_once(example: str) -> None:
    bundled = load_contract(example_contracts_dir() / f"{example}.yaml")
    contract = parse_contract({**bundled.model_dump(), "weights": "pkg:not_a_pkg/model"})
    with pytest.raises(ModelNotReady) as info:
        get_runtime(contract.runtime).load(contract)
    assert info.value.message == f"model '{contract.key}': weights: package 'not_a_pkg' is not installed"
