"""The vllm runtime serves tools and structured output as the llama.cpp engine does: tools rendered by the chat
template, a required or named call constrained to the template's format and parsed into `tool_calls`, JSON
constrained by `response_format`; what cannot be served is a 400 naming the field, and the instance serves on.

Runs ember's VLLMModel in the `vllm` environment's interpreter (vLLM does not import in ember's own environment)
on a random-weight tiny Llama whose chat template teaches Hermes tool calls: its text is noise, so only what the
constraints guarantee is checked. Needs `ember env build vllm`: skipped with that reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

from ember.environments.registry import Environments

ENV = Environments().status("vllm")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not ENV.built, reason=f"vllm runtime: {ENV.reason or 'not built'}")]

DRIVE = r"""
import json, sys
import numpy as np
from ember.errors import InvalidInput
from ember.runtimes.vllm import VLLMRuntime
from ember.testing.hf_models import vllm_contract_data
from ember.wire.contract import parse_contract

outputs = ("text", "finish_reason", "prompt_tokens", "completion_tokens", "tool_calls", "logprobs")
contract = parse_contract(vllm_contract_data("tiny-vllm", sys.argv[1], outputs))
runtime = VLLMRuntime()
runtime.preload()
model = runtime.load(contract)

def ask(fields, streamed):
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps(fields).encode()
    try:
        if not streamed:
            replies = [model.infer({"request": arr})]
        else:
            replies = [r for r in model.stream({"request": arr}) if r is not None]
    except InvalidInput as err:
        return {"error": err.message}
    text = "".join(r["text"][0].decode() for r in replies)
    calls = [r["tool_calls"][0].decode() for r in replies if r["tool_calls"][0]]
    logprobs = [e for r in replies if r["logprobs"][0] for e in json.loads(r["logprobs"][0])]
    return {"text": text, "finish": replies[-1]["finish_reason"][0].decode(), "replies": len(replies),
            "logprobs": logprobs, "prompt_tokens": int(replies[-1]["prompt_tokens"][0]),
            "tool_calls": json.loads(calls[-1]) if calls else None,
            "text_before_end": "".join(r["text"][0].decode() for r in replies[:-1])}

for line in sys.stdin:
    cmd = json.loads(line)
    print(json.dumps(ask(cmd["fields"], cmd["streamed"])), flush=True)
"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12}},
                                                "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def ask(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from ember.testing.gguf_models import CHATML_TOOLS
    from ember.testing.hf_models import tiny_llama_hf

    weights = tiny_llama_hf(tmp_path_factory.mktemp("hf") / "tiny-tools", chat_template=CHATML_TOOLS)
    proc = subprocess.Popen([str(ENV.python), "-c", DRIVE, str(weights)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})

    def one(streamed: bool = True, **fields: Any) -> dict[str, Any]:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps({"fields": fields, "streamed": streamed}) + "\n")
        proc.stdin.flush()
        for line in proc.stdout:   # vLLM logs to stdout too
            if line.startswith("{"):
                out: dict[str, Any] = json.loads(line)
                return out
        raise AssertionError(f"the driver exited {proc.wait()}")

    yield one
    proc.stdin.close()   # type: ignore[union-attr]
    proc.wait(timeout=60)


@pytest.mark.parametrize("streamed", [True, False])
def test_a_required_tool_choice_answers_a_call_of_a_given_tool(ask: Any, streamed: bool) -> None:
    out = ask(streamed, messages=CHAT, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=64,
              temperature=0)
    assert out["finish"] == "tool_calls" and out["text"] == "", out
    [call] = out["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] in ("get_weather", "get_time")
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"city"} if call["function"]["name"] == "get_weather" else {"zone"}
    if streamed:   # the call's text was held back, never streamed as content
        assert out["text_before_end"] == ""


def test_a_named_tool_choice_calls_that_tool_with_arguments_of_its_schema(ask: Any) -> None:
    out = ask(messages=CHAT, tools=[WEATHER, CLOCK], max_tokens=64, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    [call] = out["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"])["zone"] in ("UTC", "CET")


def test_a_tool_with_nested_definitions_is_called_with_arguments_of_them(ask: Any) -> None:
    """Parameters as pydantic and the openai SDK write a nested model (`$defs`, `#/$defs/...`)."""
    nested = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"room": {"$ref": "#/$defs/Room"}}, "required": ["room"],
        "$defs": {"Room": {"type": "object", "properties": {"size": {"enum": ["S", "L"]}}, "required": ["size"],
                           "additionalProperties": False}}}}}
    out = ask(messages=CHAT, tools=[nested], tool_choice="required", max_tokens=96, temperature=0)
    [call] = out["tool_calls"]
    assert json.loads(call["function"]["arguments"])["room"]["size"] in ("S", "L")


def test_a_json_schema_response_is_json_of_that_schema(ask: Any) -> None:
    # Bounded values only: a random model's integer or string runs to its budget.
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "ok": {"type": "boolean"}},
              "required": ["answer", "ok"], "additionalProperties": False}
    out = ask(messages=CHAT, max_tokens=160, temperature=0,
              response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    assert out["finish"] == "stop", out
    value = json.loads(out["text"])
    assert set(value) == {"answer", "ok"} and value["answer"] in ("yes", "no") and isinstance(value["ok"], bool)


def test_a_json_object_response_is_a_json_object(ask: Any) -> None:
    out = ask(messages=CHAT, max_tokens=48, temperature=0, response_format={"type": "json_object"})
    if out["finish"] == "stop":   # a random model may run out of tokens mid-object (finish: length)
        assert isinstance(json.loads(out["text"]), dict)
    else:
        assert out["finish"] == "length" and out["text"].lstrip().startswith("{")


def test_what_cannot_be_served_is_refused_naming_the_field_and_the_engine_serves_on(ask: Any) -> None:
    assert ask(prompt="Hi", tools=[WEATHER], max_tokens=4)["error"].startswith("tools: only with messages")
    huge = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 10**9}}}
    refused = ask(messages=CHAT, max_tokens=4, response_format={"type": "json_schema",
                                                                "json_schema": {"name": "h", "schema": huge}})
    assert refused["error"].startswith("response_format.json_schema.schema.properties.s.maxLength")
    nothing = ask(messages=CHAT, max_tokens=4, response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object", "properties": {"a": {"anyOf": []}}}}})   # was an empty reply
    assert nothing["error"].startswith("response_format.json_schema.schema.properties.a.anyOf: an empty list")
    for schema, says in (({"$ref": "#/definitions/x"}, "Cannot find field definitions"),
                         ({"type": "string", "pattern": "("}, "Regex parsing error"),
                         ({"type": "integer", "minimum": 5, "maximum": 1}, "Invalid range")):
        refused = ask(messages=CHAT, max_tokens=4, response_format={"type": "json_schema",
                                                                    "json_schema": {"name": "x", "schema": schema}})
        assert refused["error"].startswith(f"response_format.json_schema.schema: cannot be turned into a grammar: "
                                           f"{says}"), refused
    odd = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "odd"}}}}}
    assert ask(messages=CHAT, tools=[odd], tool_choice="required", max_tokens=4)["error"].startswith(
        "tools: cannot be turned into a grammar: Unsupported type")
    assert ask(messages=CHAT, max_tokens=3, temperature=0)["finish"] in ("stop", "length")


@pytest.mark.parametrize("streamed", [True, False])
def test_echo_leads_with_the_prompt_and_its_tokens_logprobs(ask: Any, streamed: bool) -> None:
    """lm-eval-harness's scoring request: echo with logprobs, one token (the gateway asks one for max_tokens 0)."""
    out = ask(streamed, prompt="The quick brown fox", echo=True, logprobs=True, max_tokens=1, temperature=0)
    assert out["text"].startswith("The quick brown fox") and out["finish"] == "length"
    entries = out["logprobs"]
    assert len(entries) == out["prompt_tokens"] + 1   # each prompt token, then the one generated
    assert entries[0]["logprob"] is None and all(e["logprob"] <= 0 for e in entries[1:])
    assert "".join(e["token"] for e in entries[: out["prompt_tokens"]]).strip() == "The quick brown fox"
    plain = ask(streamed, prompt="The quick brown fox", max_tokens=1, temperature=0)
    assert out["text"] == "The quick brown fox" + plain["text"]
