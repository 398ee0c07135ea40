"""The vllm runtime's contract checks, which run without vLLM (they come before the engine is built)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ember.errors import ContractInvalid, ModelNotReady
from ember.runtimes import KNOWN_RUNTIMES, parse_options
from ember.runtimes.vllm import VLLMOptions, check_io, model_dir
from ember.wire.contract import parse_contract

OUTPUTS = {"text": "BYTES", "finish_reason": "BYTES", "prompt_tokens": "INT64", "completion_tokens": "INT64"}


def contract(weights: Path | str = "/nowhere", outputs: dict[str, str] | None = None, **fields: Any) -> Any:
    return parse_contract({"name": "m", "runtime": "vllm", "weights": str(weights),
                           "inputs": [{"name": "request", "datatype": "BYTES", "shape": [1]}],
                           "outputs": [{"name": n, "datatype": d, "shape": [1]}
                                       for n, d in (outputs or OUTPUTS).items()], **fields})


def test_options_are_checked_naming_the_key() -> None:
    assert "vllm" in KNOWN_RUNTIMES
    options = parse_options(contract(options={"kv_cache_gb": 0.5, "max_model_len": 2048}), VLLMOptions)
    assert options.kv_cache_gb == 0.5 and options.dtype == "float32" and options.enforce_eager
    with pytest.raises(ContractInvalid, match="options.kv_cache_gb: Input should be greater than 0"):
        parse_options(contract(options={"kv_cache_gb": 0}), VLLMOptions)
    with pytest.raises(ContractInvalid, match="options.dtype: Input should be 'auto', 'float32'"):
        parse_options(contract(options={"dtype": "int4"}), VLLMOptions)
    with pytest.raises(ContractInvalid, match="options.kv_tokens: Extra inputs are not permitted"):
        parse_options(contract(options={"kv_tokens": 1024}), VLLMOptions)


def test_the_llm_convention_is_required() -> None:
    check_io(contract())
    with pytest.raises(ContractInvalid, match="outputs: the vllm runtime takes outputs text, finish_reason"):
        check_io(contract(outputs={"text": "BYTES"}))


def test_the_weights_are_a_hugging_face_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelNotReady, match="is not a Hugging Face directory \\(no config.json\\)"):
        model_dir(contract(tmp_path), None)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert model_dir(contract(tmp_path), None) == tmp_path
    with pytest.raises(ModelNotReady, match="are in a weight store and this node has none configured"):
        model_dir(contract("store:tiny:1"), None)


def test_each_tenants_prompts_are_salted_apart_in_vllms_prefix_cache() -> None:
    from ember.runtimes.vllm import VLLMModel, engine_prompt

    assert engine_prompt([1, 2], "acme") == {"prompt_token_ids": [1, 2], "cache_salt": "tenant:acme"}
    assert engine_prompt([1, 2], "beta")["cache_salt"] != engine_prompt([1, 2], "acme")["cache_salt"]
    assert engine_prompt([1, 2], None) == {"prompt_token_ids": [1, 2]}   # no tenants at all: one shared cache
    assert VLLMModel.per_tenant   # the node hands it the caller's tenant
