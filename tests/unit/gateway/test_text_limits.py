"""A contract's limits.max_string_bytes on the text of JSON routes (ember/gateway/text_limits.py): refused with a 400
naming the request's field as soon as the body is parsed, before the text is encoded, serialized again, tokenized by
the gateway's prompt check or sent to the service."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from ember.gateway import prompt_check
from ember.gateway.app import create_app
from ember.gateway.errors import ParamError
from ember.gateway.text_limits import check_text_length, utf8_within
from ember.metrics import Metrics
from ember.testing.service import FakeService, fake_contracts
from ember.wire.contract import ModelContract

LIMIT = 64


def limited(contract: ModelContract, limit: int = LIMIT) -> ModelContract:
    return contract.model_copy(update={"limits": contract.limits.model_copy(update={"max_string_bytes": limit})})


MODELS = [limited(c) for c in fake_contracts()]
CHATTER = next(c for c in MODELS if c.name == "chatter")


def test_a_text_is_refused_by_its_length_before_it_is_encoded_and_by_its_bytes_after() -> None:
    assert utf8_within(CHATTER, "é" * 32, "input[0]", "text") == ("é" * 32).encode()   # 64 bytes: at the limit
    past = r"^input\[0\]: input 'text': an element of 66 bytes exceeds the limit of 64"
    with pytest.raises(ParamError, match=past) as err:
        utf8_within(CHATTER, "é" * 33, "input[0]", "text")   # 33 characters: within by length, past by bytes
    assert err.value.param == "input"
    with pytest.raises(ParamError, match=r"^input: input 'text': an element of at least 65 bytes"):
        utf8_within(CHATTER, "x" * 65, "input", "text")


def test_the_strings_of_a_request_count_together_keys_included() -> None:
    check_text_length(CHATTER, {"messages": [{"role": "user", "content": "x" * 40}]}, "messages", "request")
    body = {"messages": [{"role": "user", "content": "x" * 40}, {"role": "user", "content": "y" * 20}]}
    with pytest.raises(ParamError, match=r"^messages: input 'request': an element of at least \d+ bytes") as err:
        check_text_length(CHATTER, body, "messages", "request")
    assert err.value.param == "messages"


@pytest.fixture
def gateway() -> Iterator[tuple[TestClient, FakeService, list[bytes]]]:
    """An app over the fake service whose models take 64-byte strings, the chat model with a prompt check that
    records what it was given (it must be given nothing past the limit)."""
    service = FakeService(models=list(MODELS))
    checked: list[bytes] = []
    key = prompt_check._deployed(CHATTER)
    prompt_check._checks[key] = checked.append
    try:
        with TestClient(create_app(service, Metrics())) as client:
            yield client, service, checked
    finally:
        prompt_check._checks.pop(key, None)


CHAT, BIG, SMALL = "chatter", "x" * 100, "hi"


@pytest.mark.parametrize(("path", "body", "field", "param"), [
    ("/v1/embeddings", lambda t: {"model": "embedder", "input": ["fine", t]}, "input[1]", "input"),
    ("/v1/embeddings", lambda t: {"model": "embedder", "input": t}, "input[0]", "input"),
    ("/v1/chat/completions", lambda t: {"model": CHAT, "messages": [{"role": "user", "content": t}]}, "messages",
     "messages"),
    ("/v1/completions", lambda t: {"model": CHAT, "prompt": t}, "prompt", "prompt"),
    ("/v2/models/chatter/generate", lambda t: {"text_input": t}, "text_input", None),
], ids=["embeddings-list", "embeddings-one", "chat", "completions", "v2-generate"])
def test_a_text_past_the_limit_is_a_400_naming_its_field_before_anything_is_made_of_it(
        gateway: tuple[TestClient, FakeService, list[bytes]], path: str, body: Callable[[str], dict[str, Any]],
        field: str, param: str | None) -> None:
    client, service, checked = gateway
    r = client.post(path, json=body(BIG))
    assert r.status_code == 400
    error = r.json()["error"]
    message = error["message"] if isinstance(error, dict) else error
    assert message.startswith(f"{field}: input '") and "of at least 100 bytes exceeds" in message
    assert "limits.max_string_bytes" in message
    if param is not None:
        assert error["param"] == param
    assert service.calls == [] and checked == []   # neither tokenized nor sent
    assert client.post(path, json=body(SMALL)).status_code == 200
    assert len(service.calls) == 1 and len(checked) == (0 if "embeddings" in path else 1)


def test_more_embedding_inputs_than_the_contracts_rows_are_refused_before_they_are_encoded() -> None:
    embedder = next(c for c in MODELS if c.name == "embedder")
    two_rows = embedder.model_copy(update={"limits": embedder.limits.model_copy(update={"max_batch_rows": 2})})
    service = FakeService(models=[two_rows])
    with TestClient(create_app(service, Metrics())) as client:
        r = client.post("/v1/embeddings", json={"model": "embedder", "input": ["a", "b", "c"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        assert r.json()["error"]["message"].startswith("input: 3 inputs exceed the limit of 2 (limits.max_batch_rows")
        assert service.calls == []
        assert client.post("/v1/embeddings", json={"model": "embedder", "input": ["a", "b"]}).status_code == 200
