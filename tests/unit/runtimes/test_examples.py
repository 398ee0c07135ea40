from __future__ import annotations

from pathlib import Path

import pytest

from ember.runtimes import KNOWN_RUNTIMES
from ember.wire.contract import example_contracts_dir, find_contracts, load_contract

EXAMPLES = find_contracts(example_contracts_dir())


def test_the_bundled_examples_are_the_embedder_and_a_python_model() -> None:
    runtimes = {load_contract(p).runtime for p in EXAMPLES}
    assert {"sentence-transformers", "python"} <= runtimes


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_bundled_example_validates_and_its_weights_exist(path: Path) -> None:
    contract = load_contract(path)
    assert contract.runtime in KNOWN_RUNTIMES
    assert path.stem == contract.name
    weights = contract.weights_path()
    assert weights is not None and weights.exists(), f"{path.name}: weights {weights} missing"


def test_python_example_is_small() -> None:
    # The tiny example ships inside the wheel; keep it tiny.
    total = sum(p.stat().st_size for p in (example_contracts_dir() / "iris_softmax").rglob("*") if p.is_file()
                and "__pycache__" not in p.parts)
    assert total < 50_000
