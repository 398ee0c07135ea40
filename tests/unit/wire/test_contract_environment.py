"""A contract's `environment` and the vllm runtime's defaults: validated once, errors naming the key."""

from __future__ import annotations

from typing import Any

import pytest

from ember.errors import ContractInvalid
from ember.wire.contract import parse_contract


def contract(**fields: Any) -> Any:
    return parse_contract({"name": "m", "inputs": [{"name": "request", "datatype": "BYTES", "shape": [1]}],
                           "outputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}], **fields})


def test_the_vllm_runtime_runs_in_its_environment_and_keeps_no_template() -> None:
    c = contract(runtime="vllm", weights="/models/x")
    assert c.environment_name == "vllm" and c.environment is None
    assert c.scaling.keep_template is False
    assert contract(runtime="vllm", environment="vllm", scaling={"max_scale": 3}).scaling.keep_template is False
    assert contract(runtime="vllm", scaling={"keep_template": False}).scaling.keep_template is False
    assert contract(runtime="llm").environment_name is None
    assert contract(runtime="llm").scaling.keep_template is True


def test_a_template_for_vllm_is_refused_naming_the_key() -> None:
    with pytest.raises(ContractInvalid, match="scaling.keep_template: runtime 'vllm' cannot fork a loaded model"):
        contract(runtime="vllm", scaling={"keep_template": True})


@pytest.mark.parametrize(("runtime", "environment", "message"), [
    ("llm", "vllm", "environment: runtime 'llm' runs in ember's own environment, not 'vllm'"),
    ("vllm", "other", "environment: runtime 'vllm' runs in environment 'vllm', not 'other'"),
    ("vllm", "Bad Name!", "environment"),
])
def test_a_wrong_environment_is_refused(runtime: str, environment: str, message: str) -> None:
    with pytest.raises(ContractInvalid, match=message):
        contract(runtime=runtime, environment=environment)
