"""A `store:` llm model's requests are checked by the gateway too: its vocabulary is read from the head of the GGUF
in the node's weight store, so a prompt its instance would refuse is a 400 before any instance starts (was: no
check for a store model, a cold start, then the instance's own 400). The contract is docs/examples/own-gguf's, its
GGUF a random-weight one without a chat template, pushed as `ember store push` pushes it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from ember.gateway import prompt_check
from ember.gateway.app import create_app
from ember.jobs.store import JobStore
from ember.metrics import Metrics
from ember.store import StoreConfig, WeightStore
from ember.testing.gguf_models import write_model
from ember.testing.service import FakeService
from ember.wire.contract import ModelContract, load_contract

EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "examples" / "own-gguf" / "my-base.yaml"
TOO_LONG = [{"role": "user", "content": "word " * 3000}]   # the tiny GGUF's context is 2048


@pytest.fixture
def contract() -> ModelContract:
    return load_contract(EXAMPLE)


@pytest.fixture
def store(tmp_path: Path, contract: ModelContract) -> Iterator[WeightStore]:
    gguf = write_model(tmp_path / "my-base.gguf", "llama", chat_template=False)
    with WeightStore(StoreConfig(root=tmp_path / "store", memory_dir=None)) as opened:
        opened.push(gguf, "my-base:1")
        prompt_check.read_store_with(lambda: opened)
        yield opened
        prompt_check.read_store_with(None)
        prompt_check._checks.clear()   # its checker read this store, gone after the test


@pytest.fixture
def client(tmp_path: Path, contract: ModelContract, store: WeightStore) -> Iterator[tuple[TestClient, FakeService]]:
    with JobStore(tmp_path / "jobs.sqlite3", max_queued=10, result_ttl_s=60.0) as jobs:
        service = FakeService(models=[contract], jobs=jobs)
        with TestClient(create_app(service, Metrics())) as c:
            yield c, service


def _message(r: Any) -> str:
    error = r.json()["error"]
    return error["message"] if isinstance(error, dict) else error


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": "my-base", "messages": TOO_LONG, "max_tokens": 4}),
    ("/v2/models/my-base/infer", {"inputs": [{"name": "request", "datatype": "BYTES", "shape": [1],
                                              "data": [json.dumps({"messages": TOO_LONG})]}]}),
])
def test_a_prompt_past_the_context_of_a_store_model_is_a_400_before_any_instance(
        client: tuple[TestClient, FakeService], path: str, body: dict[str, Any]) -> None:
    c, service = client
    r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    assert _message(r).startswith("messages: prompt of") and "exceeds the context of 2048" in _message(r)
    assert service.calls == []   # nothing reached the serving core: no instance started


def test_the_store_models_check_renders_its_contracts_template_and_tools(client: tuple[TestClient, FakeService],
                                                                        contract: ModelContract) -> None:
    c, service = client
    check = prompt_check.checker(contract)
    assert check is not None   # read from the store's GGUF head
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    check(json.dumps({"messages": [{"role": "user", "content": "Hi"}], "tools": [weather],
                      "tool_choice": "required"}).encode())
    r = c.post("/v1/chat/completions", json={"model": "my-base", "messages": [{"role": "user", "content": "Hi"}],
                                              "max_tokens": 2, "logit_bias": {"49152": 1}})
    assert r.status_code == 400 and _message(r).startswith("logit_bias.49152"), r.text
    assert service.calls == []
