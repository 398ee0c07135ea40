"""OpenAI text generation over a FakeService whose `chatter` streams one reply per word."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from ember.errors import ModelNotReady
from ember.gateway import sse
from ember.gateway.app import create_app
from ember.metrics import Metrics
from ember.testing.service import FakeService, fake_contracts

CHAT = {"model": "chatter", "messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "the capital is Paris"}]}


def events(text: str) -> list[Any]:
    """The SSE data events of a response body, JSON-decoded ([DONE] kept as a string)."""
    out = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_a_chat_completion_answers_the_whole_text_with_usage(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.headers["ember-rung"] == "hot"
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "the capital is Paris "}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}


def test_max_tokens_cuts_the_completion_with_finish_reason_length(client: TestClient) -> None:
    body = client.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 2}).json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == "the capital " and choice["finish_reason"] == "length"
    body = client.post("/v1/completions", json={"model": "chatter", "prompt": "a b c", "max_tokens": 1}).json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "a "


def test_a_streamed_chat_is_sse_as_openai_sends_it(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    got = events(r.text)
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "the capital is Paris "
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-2]["usage"] is None
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_a_streamed_completion_without_usage_has_no_usage_fields(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "chatter", "prompt": "x y", "stream": True})
    chunks = events(r.text)[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "x y "
    assert all("usage" not in c and c["object"] == "text_completion" for c in chunks)


def test_a_failure_after_the_first_byte_is_an_error_event(client: TestClient, service: FakeService) -> None:
    service.fail_stream_after = 2
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    got = events(r.text)
    assert r.status_code == 200 and "the model failed on this request" in got[-1]["error"]["message"]
    assert "[DONE]" not in got and service.closed_streams == 1


def test_a_failure_before_the_first_byte_is_a_status_code(client: TestClient, service: FakeService) -> None:
    service.failure = ModelNotReady("model 'chatter': not ready (told to)")
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


def test_a_slow_first_reply_starts_the_stream_with_keepalive_comments(
        client: TestClient, service: FakeService, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse, "HEAD_START_S", 0.01)
    monkeypatch.setattr(sse, "KEEPALIVE_S", 0.02)
    service.first_reply_delay_s = 0.1   # claimed at once (its rung known), the first reply late: a long prefill
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200 and r.text.startswith(": waiting for the first reply")
    assert r.headers["ember-rung"] == "hot" and r.headers["ember-instance"] == "fake-0"
    assert events(r.text)[-1] == "[DONE]"


def test_a_slow_start_sends_the_headers_and_keepalive_comments_before_any_claim(
        client: TestClient, service: FakeService, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing tells the rung (a request waiting for room, a stream another node serves): past HEADERS_BY_S the
    headers go without it, and the comments keep a proxy's idle timeout from cutting the stream."""
    monkeypatch.setattr(sse, "HEAD_START_S", 0.01)
    monkeypatch.setattr(sse, "HEADERS_BY_S", 0.02)
    monkeypatch.setattr(sse, "KEEPALIVE_S", 0.02)
    service.delay_s = 0.2   # before the claim: on_claim is told only then
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200 and r.text.startswith(": waiting for the first reply")
    assert "ember-rung" not in r.headers and "ember-instance" not in r.headers
    assert ": ember-rung hot" in r.text and events(r.text)[-1] == "[DONE]"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v2/models/chatter/generate_stream"])
@pytest.mark.parametrize(("claim_s", "first_reply_s"), [(0.1, 0.0), (0.0, 0.1), (0.05, 0.05)])
def test_every_stream_carries_its_rung_however_late_its_first_reply(
        client: TestClient, service: FakeService, monkeypatch: pytest.MonkeyPatch, path: str, claim_s: float,
        first_reply_s: float) -> None:
    """Past the head start the headers wait for an instance to hold the request, not for the first reply."""
    monkeypatch.setattr(sse, "HEAD_START_S", 0.01)
    monkeypatch.setattr(sse, "KEEPALIVE_S", 0.02)
    service.delay_s, service.first_reply_delay_s = claim_s, first_reply_s
    body = {"text_input": "the capital is Paris"} if path.startswith("/v2") else \
        {**CHAT, "stream": True} if "chat" in path else {"model": "chatter", "prompt": "x y", "stream": True}
    r = client.post(path, json=body)
    assert r.status_code == 200 and r.headers["ember-rung"] == "hot" and r.headers["ember-instance"] == "fake-0"
    assert events(r.text)


def test_a_full_model_answers_429_and_a_stream_never_becomes_a_job(client: TestClient, service: FakeService) -> None:
    service.no_capacity = True
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 429
    assert client.post("/v1/chat/completions", json={**CHAT, "stream": True},
                       headers={"Prefer": "respond-async"}).status_code == 429
    r = client.post("/v1/chat/completions", json=CHAT, headers={"Prefer": "respond-async"})
    assert r.status_code == 202 and r.headers["location"].startswith("/v2/jobs/")


@pytest.mark.parametrize(("patch", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logit_bias": {"one": 2}}, "logit_bias"),
    ({"logit_bias": {"1": 200}}, "logit_bias"),
    ({"logit_bias": {"2147483648": 1}}, "logit_bias"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}], "tools": [{"type": "function"}]}, "tools"),
    ({"model": "embedder"}, "model"),
])
def test_bad_requests_are_400s_naming_the_field(client: TestClient, patch: dict[str, Any], param: str) -> None:
    r = client.post("/v1/chat/completions", json={**CHAT, **patch})
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["message"].startswith(param), error


def test_malformed_json_is_a_400(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["model", "messages", "max_tokens", "temperature", "top_p", "seed", "stop",
                                        "n", "stream", "stream_options", "prompt", "user"]), _json, max_size=6))
def test_any_json_object_is_answered_without_a_server_error(client: TestClient, body: dict[str, Any]) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        assert r.status_code < 500, r.text


def test_generation_metrics_count_tokens_and_time_streams(client: TestClient) -> None:
    client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    client.post("/v1/chat/completions", json=CHAT)
    text = client.get("/metrics").text
    assert 'ember_time_to_first_token_seconds_count{model="chatter",rung="hot",version="1"} 1.0' in text
    assert 'ember_time_per_output_token_seconds_count{model="chatter",rung="hot",version="1"} 3.0' in text
    assert 'ember_generation_tokens_total{kind="completion",model="chatter",version="1"} 8.0' in text
    assert 'ember_generation_tokens_total{kind="prompt",model="chatter",version="1"} 14.0' in text
    assert 'ember_streams_in_flight{model="chatter",version="1"} 0.0' in text


def test_a_stream_whose_first_replies_count_no_token_is_timed_once_and_ends(client: TestClient) -> None:
    """An echoed prompt's reply counts no completion token (nor does a stream's end-of-sequence token): the stream
    is still started once, timed once, and ended."""
    with client.stream("POST", "/v1/completions", json={"model": "chatter", "prompt": "x y", "echo": True,
                                                        "stream": True}) as r:
        assert r.status_code == 200 and "[DONE]" in "".join(r.iter_text())
    text = client.get("/metrics").text
    assert 'ember_time_to_first_token_seconds_count{model="chatter",rung="hot",version="1"} 1.0' in text
    assert 'ember_streams_in_flight{model="chatter",version="1"} 0.0' in text
    assert 'ember_generation_tokens_total{kind="completion",model="chatter",version="1"} 2.0' in text


def test_max_tokens_over_the_contracts_limit_is_a_400_naming_it() -> None:
    models = [c.model_copy(update={"limits": c.limits.model_copy(update={"max_tokens": 8})}) for c in fake_contracts()]
    with TestClient(create_app(FakeService(models=models), Metrics())) as client:
        r = client.post("/v1/chat/completions", json={"model": "chatter", "max_tokens": 9,
                                                      "messages": [{"role": "user", "content": "a b"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        # The runtime's message (ember.wire.generation.within_limit): the same whichever side refuses it.
        assert r.json()["error"]["message"] == "max_tokens: 9 exceeds the limit of 8 (the contract's limits.max_tokens)"
        r = client.post("/v2/models/chatter/generate", json={"text_input": "a", "parameters": {"max_tokens": 9}})
        assert r.status_code == 400 and r.json()["error"].startswith("max_tokens: 9 exceeds the limit of 8")
        r = client.post("/v1/completions", json={"model": "chatter", "prompt": "a b", "max_tokens": 8})
        assert r.status_code == 200


@pytest.mark.parametrize("patch", [{"temperature": 2.5}, {"top_p": 0}, {"stop": ["a", ""]}, {"seed": 1.5},
                                   {"logit_bias": {"x": 1}}, {"logit_bias": {"3": 101}}])
def test_a_sampling_field_is_refused_with_the_runtimes_message_on_every_route(client: TestClient,
                                                                               patch: dict[str, Any]) -> None:
    """One rule per field (ember.wire.generation): the chat and completions APIs, V2 generate and the runtime's
    own parse refuse it with the same message."""
    from ember.errors import InvalidInput
    from ember.wire.generation import parse_request

    with pytest.raises(InvalidInput) as err:
        parse_request(json.dumps({"prompt": "a", **patch}).encode())
    runtime = str(err.value)
    chat = client.post("/v1/chat/completions", json={**CHAT, **patch}).json()["error"]
    completion = client.post("/v1/completions", json={"model": "chatter", "prompt": "a", **patch}).json()["error"]
    generate = client.post("/v2/models/chatter/generate", json={"text_input": "a", "parameters": patch}).json()
    assert chat["message"] == completion["message"] == runtime and chat["param"] == next(iter(patch))
    assert generate["error"] == f"parameters.{runtime}"
