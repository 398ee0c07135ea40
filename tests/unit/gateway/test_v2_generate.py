"""The V2 generate extension (Triton's) over a FakeService whose `chatter` streams one reply per word."""

from __future__ import annotations

import json

from starlette.testclient import TestClient

from ember.testing.service import FakeService


def test_generate_answers_the_whole_text(client: TestClient) -> None:
    r = client.post("/v2/models/chatter/generate", json={"text_input": "red green blue",
                                                          "parameters": {"max_tokens": 2, "temperature": 0}})
    assert r.status_code == 200 and r.headers["ember-rung"] == "hot"
    assert r.json() == {"model_name": "chatter", "model_version": "1", "text_output": "red green ",
                        "finish_reason": "length", "prompt_tokens": 6, "completion_tokens": 2}
    assert client.post("/v2/models/chatter/versions/1/generate", json={"text_input": "x"}).status_code == 200


def test_generate_stream_sends_one_event_per_reply(client: TestClient) -> None:
    r = client.post("/v2/models/chatter/generate_stream", json={"text_input": "red green blue"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["text_output"] for e in events] == ["red ", "green ", "blue "]
    assert events[-1]["finish_reason"] == "stop" and all(e["model_name"] == "chatter" for e in events)


def test_a_stream_failing_midway_ends_with_an_error_event(client: TestClient, service: FakeService) -> None:
    service.fail_stream_after = 1
    r = client.post("/v2/models/chatter/generate_stream", json={"text_input": "red green blue"})
    last = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")][-1]
    assert "the model failed on this request" in last["error"]


def test_bad_generate_requests_are_400s_naming_the_field(client: TestClient) -> None:
    for body, field in (({}, "text_input"), ({"text_input": "x", "parameters": {"max_tokens": 0}}, "max_tokens"),
                        ({"text_input": "x", "parameters": {"temperature": 9}}, "temperature"),
                        ({"text_input": "x", "temperature": 9}, "temperature"),
                        ({"text_input": "x", "max_tokens": 2, "parameters": {"max_tokens": 3}}, "max_tokens"),
                        ({"text_input": "x", "parameters": {"top_logprobs": 3}}, "top_logprobs"),
                        ({"text_input": "x", "parameters": []}, "parameters")):
        r = client.post("/v2/models/chatter/generate", json=body)
        assert r.status_code == 400 and field in r.json()["error"], (body, r.text)
    r = client.post("/v2/models/affine/generate", json={"text_input": "x"})
    assert r.status_code == 400 and "not a text-generation model" in r.json()["error"]
    assert client.post("/v2/models/nope/generate", json={"text_input": "x"}).status_code == 404


def test_extra_top_level_fields_are_parameters_as_triton_takes_them(client: TestClient, service: FakeService) -> None:
    r = client.post("/v2/models/chatter/generate", json={
        "text_input": "red green blue", "max_tokens": 2, "temperature": 0, "seed": 7, "stop": ["zzz"],
        "id": "req-1", "exclude_input_in_output": True, "parameters": {"top_p": 0.5, "return_finish_reason": True}})
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == "red green " and r.json()["finish_reason"] == "length"
    sent = json.loads(bytes(service.calls[-1].inputs["request"][0]))
    assert sent == {"prompt": "red green blue", "max_tokens": 2, "temperature": 0, "seed": 7, "stop": ["zzz"],
                    "top_p": 0.5}
    same = client.post("/v2/models/chatter/generate", json={"text_input": "a", "max_tokens": 1,
                                                            "parameters": {"max_tokens": 1}})
    assert same.status_code == 200


def test_generate_with_logprobs_answers_them(client: TestClient, service: FakeService) -> None:
    r = client.post("/v2/models/chatter/generate", json={"text_input": "red green", "logprobs": True,
                                                          "top_logprobs": 2, "logit_bias": {"5": -100}})
    body = r.json()
    assert [e["token"] for e in body["logprobs"]] == ["red ", "green "]
    assert len(body["logprobs"][0]["top_logprobs"]) == 2
    sent = json.loads(bytes(service.calls[-1].inputs["request"][0]))
    assert sent["logprobs"] is True and sent["top_logprobs"] == 2 and sent["logit_bias"] == {"5": -100}
    r = client.post("/v2/models/chatter/generate_stream", json={"text_input": "red green",
                                                                 "parameters": {"logprobs": True}})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["logprobs"][0]["token"] for e in events] == ["red ", "green "]
    plain = client.post("/v2/models/chatter/generate", json={"text_input": "red", "logprobs": False}).json()
    assert "logprobs" not in plain
