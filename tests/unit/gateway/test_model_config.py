"""Triton's model configuration, built from a contract (`ember.gateway.model_config`)."""

from __future__ import annotations

from google.protobuf import json_format

from ember.gateway.model_config import triton_config
from ember.wire.contract import example_contracts_dir, load_contract
from ember.wire.grpc import model_config_pb2


def test_tritons_model_configuration_from_the_bundled_contracts() -> None:
    iris, minilm, smollm2 = (load_contract(example_contracts_dir() / f"{m}.yaml") for m in ("iris", "minilm",
                                                                                             "smollm2"))
    config = triton_config(iris)
    assert config["max_batch_size"] == iris.limits.max_batch_rows
    assert config["input"] == [{"name": "features", "data_type": "TYPE_FP32", "dims": [4]}]
    assert config["output"][1:] == [{"name": "label", "data_type": "TYPE_INT64", "dims": [1], "reshape": {"shape": []}},
                                    {"name": "species", "data_type": "TYPE_STRING", "dims": [1],
                                     "reshape": {"shape": []}}]
    assert triton_config(minilm)["dynamic_batching"] == {"preferred_batch_size": [],
                                                         "max_queue_delay_microseconds": 2000}
    llm = triton_config(smollm2)
    assert llm["max_batch_size"] == 0 and "model_transaction_policy" not in llm   # unary infer answers one row
    assert llm["input"] == [{"name": "request", "data_type": "TYPE_STRING", "dims": [1]}]
    assert "dynamic_batching" not in llm
    for contract in (iris, minilm, smollm2):   # every key is one of Triton's ModelConfig
        json_format.ParseDict(triton_config(contract), model_config_pb2.ModelConfig())
