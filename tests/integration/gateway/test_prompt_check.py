"""The `llm` runtime's checks that need the model's vocabulary, run by the gateway (the GGUF loaded vocabulary
only) before a job is accepted: an async request (`Prefer: respond-async`) with a `logit_bias` id past the
vocabulary, or a lone surrogate escaped inside a V2 `request`, was accepted (202) and failed later, while its
synchronous twin was a 400. Now each is a 400 naming the field, both ways, and nothing reaches the service."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from ember.gateway.app import create_app
from ember.jobs.store import JobStore
from ember.metrics import Metrics
from ember.testing.service import FakeService
from ember.wire.contract import example_contracts_dir, load_contract

SMOLLM2 = load_contract(example_contracts_dir() / "smollm2.yaml")
VOCABULARY = 49152   # SmolLM2's


@pytest.fixture
def service(tmp_path: Path) -> Iterator[FakeService]:
    with JobStore(tmp_path / "jobs.sqlite3", max_queued=10, result_ttl_s=60.0) as jobs:
        yield FakeService(models=[SMOLLM2], jobs=jobs)


@pytest.fixture
def client(service: FakeService) -> Iterator[TestClient]:
    with TestClient(create_app(service, Metrics())) as c:
        yield c


def _v2_request(request: dict[str, Any]) -> dict[str, Any]:
    return {"inputs": [{"name": "request", "datatype": "BYTES", "shape": [1], "data": [json.dumps(request)]}]}


PAST_THE_VOCABULARY = [
    ("/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 2, "logit_bias": {str(VOCABULARY): 5}}),
    ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                              "logit_bias": {"60000": -100}}),
    ("/v2/models/smollm2/generate", {"text_input": "Hi", "parameters": {"max_tokens": 2,
                                                                         "logit_bias": {"99999": 1}}}),
    ("/v2/models/smollm2/infer", _v2_request({"prompt": "Hi", "max_tokens": 2, "logit_bias": {"49152": 1}})),
]


def _message(r: Any) -> str:
    error = r.json()["error"]
    return error["message"] if isinstance(error, dict) else error


@pytest.mark.parametrize("prefer", ["respond-async", None])
@pytest.mark.parametrize(("path", "body"), PAST_THE_VOCABULARY, ids=[p for p, _ in PAST_THE_VOCABULARY])
def test_a_logit_bias_past_the_vocabulary_is_a_400_before_any_job(client: TestClient, service: FakeService,
                                                                  path: str, body: dict[str, Any],
                                                                  prefer: str | None) -> None:
    r = client.post(path, json=body, headers={"Prefer": prefer} if prefer else {})
    assert r.status_code == 400, r.text
    assert _message(r).startswith("logit_bias.") and f"vocabulary has {VOCABULARY}" in _message(r)
    assert service.calls == []


def test_a_logit_bias_within_the_vocabulary_is_accepted_as_a_job(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2,
                                             "logit_bias": {str(VOCABULARY - 1): 5}},
                    headers={"Prefer": "respond-async"})
    assert r.status_code == 202, r.text


@pytest.mark.parametrize("prefer", ["respond-async", None])
def test_a_lone_surrogate_escaped_inside_a_v2_request_is_a_400_naming_the_field(
        client: TestClient, service: FakeService, prefer: str | None) -> None:
    """The outer JSON is plain ASCII (`\\\\ud800` inside a string); the generation request it carries holds the
    escape, which the instance's tokenizer could not encode."""
    body = _v2_request({"messages": [{"role": "user", "content": "a\ud800"}], "max_tokens": 2})
    r = client.post("/v2/models/smollm2/infer", json=body, headers={"Prefer": prefer} if prefer else {})
    assert r.status_code == 400, r.text
    assert _message(r).startswith("messages[0].content: holds a lone UTF-16 surrogate")
    assert service.calls == []


def test_a_response_format_schema_that_is_no_grammar_is_a_400_before_any_job(client: TestClient,
                                                                             service: FakeService) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(unclosed"}}}}}
    body = _v2_request({"prompt": "Hi", "max_tokens": 2, "response_format": fmt})
    r = client.post("/v2/models/smollm2/infer", json=body, headers={"Prefer": "respond-async"})
    assert r.status_code == 400 and _message(r).startswith("response_format"), r.text
    assert service.calls == []
