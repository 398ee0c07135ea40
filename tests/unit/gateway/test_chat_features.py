"""The OpenAI features apps send by default (issue 29 §5), over a FakeService whose `chatter` follows
`docs/llm-convention.md`: what the gateway accepts, what it sends the runtime, and how it shapes the replies."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.testclient import TestClient

from ember.gateway.app import create_app
from ember.metrics import Metrics
from ember.testing.service import FakeService, fake_contracts
from ember.wire.contract import parse_contract

USER = {"role": "user", "content": "the capital is Paris"}
CHAT: dict[str, Any] = {"model": "chatter", "messages": [USER]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def events(text: str) -> list[Any]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def sent(service: FakeService, i: int = -1) -> dict[str, Any]:
    """The generation request the gateway sent the runtime (the `request` input, as JSON)."""
    body: dict[str, Any] = json.loads(bytes(service.calls[i].inputs["request"][0]))
    return body


def chat(client: TestClient, **patch: Any) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json={**CHAT, **patch})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


# ---------------------------------------------------------------------------------------------- what is accepted


def test_what_clients_send_by_default_is_accepted_and_null_means_the_default(
        client: TestClient, service: FakeService) -> None:
    body = chat(client, temperature=None, top_p=None, n=None, max_tokens=None, seed=None, stop=None,
                stream=False, stream_options=None, tools=[], tool_choice="none", response_format={"type": "text"},
                logprobs=False, top_logprobs=None, logit_bias={}, user="u-1", metadata={"app": "x"}, store=False,
                service_tier="auto", parallel_tool_calls=True, frequency_penalty=0, presence_penalty=None,
                prediction=None, modalities=["text"], audio=None, functions=None, function_call=None,
                reasoning_effort=None, prompt_cache_key="k", safety_identifier="s")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "the capital is Paris "}
    assert body["choices"][0]["logprobs"] is None
    assert sent(service) == {"messages": [USER]}   # every default left to the runtime


def test_developer_role_text_parts_and_null_assistant_content(client: TestClient, service: FakeService) -> None:
    messages = [{"role": "developer", "content": [{"type": "text", "text": "be brief"},
                                                  {"type": "text", "text": "and kind"}]},
                {"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": None, "refusal": None},
                {"role": "user", "content": [{"type": "text", "text": "one two"}]}]
    body = chat(client, messages=messages)
    assert body["choices"][0]["message"]["content"] == "one two "
    assert sent(service)["messages"] == [{"role": "system", "content": "be brief\nand kind"},
                                         {"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": None},
                                         {"role": "user", "content": "one two"}]


def test_sampling_fields_reach_the_runtime(client: TestClient, service: FakeService) -> None:
    chat(client, temperature=0, top_p=0.9, seed=3, stop="zzz", max_tokens=9, max_completion_tokens=5,
         logit_bias={"42": -100, "7": 2.5})
    assert sent(service) == {"messages": [USER], "temperature": 0, "top_p": 0.9, "seed": 3, "stop": "zzz",
                             "max_tokens": 5, "logit_bias": {"42": -100, "7": 2.5}}


def test_a_response_format_reaches_the_runtime_and_shapes_the_answer(client: TestClient, service: FakeService) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}}}
    body = chat(client, response_format={"type": "json_schema",
                                         "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    assert json.loads(body["choices"][0]["message"]["content"]) == {"city": "the capital is Paris", "n": 4}
    assert sent(service)["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": schema, "strict": True}}
    body = chat(client, response_format={"type": "json_object"})
    assert json.loads(body["choices"][0]["message"]["content"]) == {"text": "the capital is Paris"}
    assert sent(service)["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize(("patch", "field"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
     "messages[0].tool_calls[0].function"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"modalities": ["audio"]}, "modalities[0]"),
    ({"web_search_options": {}}, "chat completion request"),   # {} is nothing: accepted
])
def test_odd_shapes_are_400s_that_start_with_the_field(client: TestClient, patch: dict[str, Any], field: str) -> None:
    r = client.post("/v1/chat/completions", json={**CHAT, **patch})
    if field == "chat completion request":
        assert r.status_code == 200
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(field + ": "), r.json()
    assert r.json()["error"]["param"] == field


# ----------------------------------------------------------------------------------------------------- logprobs


def test_chat_logprobs_are_openais_content_list(client: TestClient, service: FakeService) -> None:
    body = chat(client, logprobs=True, top_logprobs=2)
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["the ", "capital ", "is ", "Paris "]
    assert content[0] == {"token": "the ", "logprob": -0.25, "bytes": list(b"the "), "top_logprobs": [
        {"token": "the ", "logprob": -0.25, "bytes": list(b"the ")},
        {"token": "alt1", "logprob": -1.25, "bytes": list(b"alt1")}]}
    assert sent(service)["logprobs"] is True and sent(service)["top_logprobs"] == 2


def test_streamed_logprobs_come_with_each_piece(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True, "logprobs": True})
    chunks = [c for c in events(r.text)[:-1] if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert [c["choices"][0]["logprobs"]["content"][0]["token"] for c in chunks] == ["the ", "capital ", "is ",
                                                                                   "Paris "]
    assert all(c["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == [] for c in chunks)


def test_logprobs_of_a_model_without_them_is_a_400() -> None:
    bare = [c if c.name != "chatter" else parse_contract({
        **c.model_dump(include={"name", "runtime", "entrypoint"}),
        "inputs": [i.model_dump() for i in c.inputs],
        "outputs": [o.model_dump() for o in c.outputs if o.name not in ("logprobs", "tool_calls")]})
        for c in fake_contracts()]
    with TestClient(create_app(FakeService(models=bare), Metrics())) as client:
        r = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        r = client.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER]})
        assert r.status_code == 400 and "does not return tool calls" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"model": "chatter", "prompt": "a", "logprobs": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        assert client.post("/v1/chat/completions", json={**CHAT, "logprobs": False, "tools": [WEATHER],
                                                         "tool_choice": "none"}).status_code == 200


# --------------------------------------------------------------------------------------------------- tool calls


def test_a_tool_call_is_message_tool_calls_with_null_content(client: TestClient, service: FakeService) -> None:
    body = chat(client, messages=[{"role": "user", "content": "weather in Paris?"}], tools=[WEATHER, CLOCK])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [{"id": "call_0_get_weather", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "weather in Paris?", "days": 3})}}]
    assert sent(service)["tools"] == [WEATHER, CLOCK] and "tool_choice" not in sent(service)


def test_the_tool_loop_sends_calls_and_answers_back(client: TestClient, service: FakeService) -> None:
    call = {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_9", "content": "sunny", "name": "get_weather"}]
    body = chat(client, messages=messages, tools=[WEATHER], tool_choice="auto")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "the tool said sunny "}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert sent(service)["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_9", "name": "get_weather"}]
    assert sent(service)["tool_choice"] == "auto"


def test_a_named_tool_choice_reaches_the_runtime(client: TestClient, service: FakeService) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    body = chat(client, tools=[WEATHER, CLOCK], tool_choice=choice)
    assert [c["function"]["name"] for c in body["choices"][0]["message"]["tool_calls"]] == ["get_time"]
    assert sent(service)["tool_choice"] == choice


def test_streamed_tool_calls_are_deltas_by_index(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={
        **CHAT, "stream": True, "tools": [WEATHER, CLOCK],
        "messages": [{"role": "user", "content": "get_weather and get_time please"}]})
    chunks = events(r.text)[:-1]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [(c["index"], c["id"], c["type"], c["function"]["name"]) for c in calls] == [
        (0, "call_0_get_weather", "function", "get_weather"), (1, "call_1_get_time", "function", "get_time")]
    assert json.loads(calls[1]["function"]["arguments"]) == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" and deltas[-1] == {}
    assert not any(d.get("content") for d in deltas)


# ----------------------------------------------------------------------------------------------------------- n


def test_n_choices_are_n_requests_with_seeds_s_plus_i(client: TestClient, service: FakeService) -> None:
    body = chat(client, n=3, seed=10, max_tokens=2)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "the capital " for c in body["choices"])
    assert [sent(service, i)["seed"] for i in (-3, -2, -1)] == [10, 11, 12]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13}
    chat(client, n=2)
    assert "seed" not in sent(service, -1) and "seed" not in sent(service, -2)


def test_n_streams_interleave_chunks_by_index(client: TestClient, service: FakeService) -> None:
    r = client.post("/v1/chat/completions", json={**CHAT, "n": 2, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    chunks = events(r.text)[:-1]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        texts[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content", "")
    assert texts == {0: "the capital is Paris ", 1: "the capital is Paris "}
    finishes = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]
                if c["choices"][0]["finish_reason"]]
    assert finishes == [(0, "stop"), (1, "stop")]
    assert chunks[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15}
    assert service.closed_streams == 2


def test_one_failing_choice_fails_the_request_and_withdraws_the_others(
        client: TestClient, service: FakeService) -> None:
    service.fail_stream_after = 1
    r = client.post("/v1/chat/completions", json={**CHAT, "n": 2, "stream": True})
    assert "the model failed on this request" in events(r.text)[-1]["error"]["message"] and service.closed_streams == 2
    service.no_capacity = True
    assert client.post("/v1/chat/completions", json={**CHAT, "n": 2}).status_code == 429
    r = client.post("/v1/chat/completions", json={**CHAT, "n": 2}, headers={"Prefer": "respond-async"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


# ------------------------------------------------------------------------------------------------ completions


def test_completions_echo_with_logprobs_is_the_legacy_shape(client: TestClient, service: FakeService) -> None:
    r = client.post("/v1/completions", json={"model": "chatter", "prompt": "a bb", "echo": True, "logprobs": 2,
                                             "max_tokens": 1, "temperature": 0})
    choice = r.json()["choices"][0]
    assert choice["text"] == "a bba "
    assert choice["logprobs"] == {"tokens": ["a ", "bb", "a "], "token_logprobs": [None, -0.5, -0.25],
                                  "top_logprobs": [None, {"bb": -0.5, "alt1": -1.5}, {"a ": -0.25, "alt1": -1.25}],
                                  "text_offset": [0, 2, 4]}
    assert sent(service) == {"prompt": "a bb", "echo": True, "logprobs": True, "top_logprobs": 2, "max_tokens": 1,
                             "temperature": 0}


def test_lm_eval_loglikelihood_max_tokens_0_gives_the_prompt_alone(client: TestClient, service: FakeService) -> None:
    r = client.post("/v1/completions", json={"model": "chatter", "prompt": ["a bb", "c"], "echo": True,
                                             "logprobs": 1, "max_tokens": 0, "temperature": 0, "seed": 1234})
    body = r.json()
    assert [c["text"] for c in body["choices"]] == ["a bb", "c"]
    assert body["choices"][0]["logprobs"]["tokens"] == ["a ", "bb"]
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [None, -0.5]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"]["completion_tokens"] == 0 and sent(service)["max_tokens"] == 1


def test_completions_logprobs_without_echo_offset_from_the_prompt(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "chatter", "prompt": "xy z", "logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["xy ", "z "] and lp["text_offset"] == [4, 7] and lp["top_logprobs"] == [{}, {}]


def test_several_prompts_and_n_number_choices_prompt_major(client: TestClient, service: FakeService) -> None:
    r = client.post("/v1/completions", json={"model": "chatter", "prompt": ["a", "b c"], "n": 2, "seed": 5})
    body = r.json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "a "), (1, "a "), (2, "b c "), (3, "b c ")]
    assert [sent(service, i)["seed"] for i in range(-4, 0)] == [5, 6, 5, 6]
    assert body["usage"] == {"prompt_tokens": 4 + 5, "completion_tokens": 6, "total_tokens": 15}
    r = client.post("/v1/completions", json={"model": "chatter", "prompt": ["a", "b c"], "stream": True,
                                             "echo": True, "logprobs": 1})
    chunks = events(r.text)[:-1]
    echoed = [c["choices"][0] for c in chunks if c["choices"][0]["text"] in ("a", "b c")]
    assert sorted(c["index"] for c in echoed) == [0, 1]
    assert all(c["logprobs"]["text_offset"][0] == 0 for c in echoed)


@pytest.mark.parametrize(("patch", "field"), [
    ({"prompt": [[1, 2, 3]]}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"logprobs": 6}, "logprobs"),
    ({"logprobs": True, "echo": True}, "completion request"),     # a bool is 1 to pydantic: accepted
    ({"best_of": 3}, "best_of"),
    ({"suffix": "end"}, "suffix"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 0, "echo": True, "stream": True}, "max_tokens"),
    ({"prompt": ["a"] * 9, "n": 8}, "n"),
])
def test_bad_completions_are_400s_naming_the_field(client: TestClient, patch: dict[str, Any], field: str) -> None:
    r = client.post("/v1/completions", json={"model": "chatter", "prompt": "a", **patch})
    if field == "completion request":
        assert r.status_code == 200
        return
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(field + ": "), r.text


# ------------------------------------------------------------------------------------------------------ models


def test_get_one_model_and_404_in_openais_shape(client: TestClient) -> None:
    card = client.get("/v1/models/chatter").json()
    assert card["id"] == "chatter" and card["object"] == "model" and card["owned_by"] == "ember"
    assert client.get("/v1/models/chatter:1").json()["id"] == "chatter:1"
    r = client.get("/v1/models/gpt-9")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    assert client.get("/v1/models/chatter:7").status_code == 404


def test_a_client_leaving_a_stream_of_n_choices_closes_every_one() -> None:
    from ember.gateway import sse
    from ember.gateway.chat_api import request_tensor
    from ember.gateway.chat_shape import ChatShape

    async def leave_early() -> tuple[FakeService, list[str], list[asyncio.Task[Any]]]:
        service = FakeService(reply_delay_s=0.01)
        contract = service.contract("chatter")
        inputs = [request_tensor(contract, {"messages": [{"role": "user", "content": "a b c d e f g h"}]})] * 3
        opening = asyncio.ensure_future(sse._open_all(service, contract, inputs))
        timings = [sse._Timing(Metrics(), contract.key) for _ in inputs]
        stream = sse._events(opening, ChatShape("chatter", choices=3), timings)
        got = [await anext(stream) for _ in range(7)]
        await stream.aclose()
        return service, got, [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    service, got, left = asyncio.run(leave_early())
    assert service.closed_streams == 3 and not left
    assert sum('"content":"a "' in e for e in got) >= 2
