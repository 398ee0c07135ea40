"""Every architecture ember.testing.gguf_models writes, through LLMRuntime on llama.cpp; tool calls forced by a
grammar in each tool format; tools refused by a template that has none.

The models are tiny and random (2 layers, width 64, SmolLM2's vocabulary): their text means nothing, but the
loader checks every tensor against the architecture and a grammar bounds what they may say.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ember.errors import InvalidInput
from ember.runtimes.llm import LLMModel, LLMRuntime
from ember.runtimes.llm_tools import HERMES, JSON, LLAMA3, MISTRAL, ToolFormat
from ember.testing.gguf_models import ARCHITECTURES

TinyModel = Callable[..., LLMModel]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome", "Lima"]}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def request(**fields: Any) -> dict[str, np.ndarray]:
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps(fields).encode()
    return {"request": arr}


def text(replies: list[dict[str, np.ndarray]]) -> str:
    return "".join(bytes(r["text"][0]).decode() for r in replies)


def calls_of(reply: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    raw = bytes(reply["tool_calls"][0])
    return json.loads(raw) if raw else []


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_loads_and_streams(tiny_model: TinyModel, arch: str) -> None:
    model = tiny_model(arch)
    assert model.engine.architecture == arch and model.context == 2048
    prompt = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods. " * 2
    replies = list(model.stream(request(prompt=prompt, temperature=0, max_tokens=8)))
    assert [int(r["completion_tokens"][0]) for r in replies] == list(range(1, len(replies) + 1))
    assert [bytes(r["finish_reason"][0]) for r in replies[:-1]] == [b""] * (len(replies) - 1)
    assert len(replies) == 8 and bytes(replies[-1]["finish_reason"][0]) == b"length"
    assert int(replies[0]["cached_tokens"][0]) == 0
    # The same prompt again: its KV comes from the prefix cache and changes no token. A sliding-window model
    # cannot cut a cached entry back by the one token whose logits are needed (the window's positions are
    # gone): it reuses only entries that are whole prefixes of the prompt, so this prompt longer by a sentence.
    if model.engine.can_cut:
        again = list(model.stream(request(prompt=prompt, temperature=0, max_tokens=8)))
        assert int(again[-1]["cached_tokens"][0]) == int(again[-1]["prompt_tokens"][0]) - 1
        assert text(again) == text(replies)
    else:
        base = list(model.stream(request(prompt=prompt.rstrip(), temperature=0, max_tokens=1)))
        longer = list(model.stream(request(prompt=prompt.rstrip() + " The end.", temperature=0, max_tokens=8)))
        assert int(longer[-1]["cached_tokens"][0]) == int(base[-1]["prompt_tokens"][0])
    chat = list(model.stream(request(messages=ASK, temperature=0, max_tokens=4)))   # its chat template
    assert len(chat) == 4


def test_repack_template_repacks_in_a_template_only(tiny_model: TinyModel) -> None:
    """`repack: template`: a zygote's child maps the file as it is, a template (its replicas share what it loads)
    loads the contract `template_contract` gives it, repacked; both serve the same greedy text."""
    child = tiny_model("llama", repack="template")
    template = tiny_model("llama", repack=True)   # what LLMRuntime.template_contract makes of it
    assert (child.engine.repack, template.engine.repack) == (False, True)
    runtime = LLMRuntime()
    adapted = runtime.template_contract(child.contract)
    assert adapted.options["repack"] is True and runtime.template_contract(template.contract) is template.contract
    ask = request(prompt="The quick brown fox", temperature=0, max_tokens=4)
    assert text(list(child.stream(ask))) == text(list(template.stream(ask)))


@pytest.mark.slow
def test_a_quantised_kv_cache_serves(smollm2: LLMModel) -> None:
    """q8_0 KV (flash attention on): SmolLM2's heads of 64 divide into its blocks of 32 (the tiny models' 16
    do not: llama.cpp refuses that context)."""
    model = LLMModel(smollm2.contract, smollm2.engine, smollm2.options.model_copy(update={"kv_type": "q8_0"}),
                     smollm2.model_id)
    replies = list(model.stream(request(prompt="Once upon a time", temperature=0, max_tokens=6)))
    assert len(replies) == 6 and bytes(replies[-1]["finish_reason"][0]) == b"length" and text(replies)


def test_tool_choice_required_forces_a_call_the_hermes_template_teaches(tiny_model: TinyModel) -> None:
    model = tiny_model("qwen2")
    assert model.tool_format is HERMES
    replies = list(model.stream(request(messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
                                        temperature=0, max_tokens=64)))
    last = replies[-1]
    assert bytes(last["finish_reason"][0]) == b"tool_calls"
    assert text(replies) == ""   # a call is not text
    assert all(bytes(r["tool_calls"][0]) == b"" for r in replies[:-1])
    calls = calls_of(last)
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    name, arguments = calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"])
    assert (name, set(arguments)) in (("get_weather", {"city"}), ("get_time", {"zone"}))
    assert arguments.get("city", "Oslo") in ("Oslo", "Rome", "Lima")
    assert arguments.get("zone", "utc") in ("utc", "local")
    # A named function: that one, sampled with a seed, still within its enum.
    named = list(model.stream(request(messages=ASK, tools=[WEATHER, CLOCK], temperature=1.0, seed=3, max_tokens=64,
                                      tool_choice={"type": "function", "function": {"name": "get_time"}})))
    calls = calls_of(named[-1])
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    assert json.loads(calls[0]["function"]["arguments"])["zone"] in ("utc", "local")


def test_with_tool_choice_auto_a_model_that_answers_in_text_sends_text(tiny_model: TinyModel) -> None:
    model = tiny_model("qwen2")
    replies = list(model.stream(request(messages=ASK, tools=[WEATHER], temperature=0, max_tokens=6)))
    assert bytes(replies[-1]["finish_reason"][0]) in (b"length", b"stop") and calls_of(replies[-1]) == []
    assert text(replies) and text(replies[:1])   # not held back: its first token cannot begin a call
    none = list(model.stream(request(messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0,
                                     max_tokens=6)))
    assert text(none) == text(list(model.stream(request(messages=ASK, temperature=0, max_tokens=6))))


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL, JSON], ids=lambda f: f.name)
def test_each_tool_formats_grammar_compiles_in_llama_cpp_and_its_call_parses(tiny_model: TinyModel,
                                                                             fmt: ToolFormat) -> None:
    model = tiny_model("qwen2")
    model.tool_format = fmt   # as if its template taught this format (the grammar and the parser are the format's)
    for seed in (1, 2):
        replies = list(model.stream(request(messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
                                            temperature=0.8, seed=seed, max_tokens=80)))
        assert bytes(replies[-1]["finish_reason"][0]) == b"tool_calls", text(replies)
        (call,) = calls_of(replies[-1])
        assert call["function"]["name"] in ("get_weather", "get_time")
        assert set(json.loads(call["function"]["arguments"])) <= {"city", "zone"}


def test_a_template_without_tools_refuses_them(tiny_model: TinyModel) -> None:
    model = tiny_model("llama")   # SmolLM2's own chat template: it renders no tools
    assert model.tool_format is None
    with pytest.raises(InvalidInput, match=r"^tools: the model's chat template has no tool format"):
        list(model.stream(request(messages=ASK, tools=[WEATHER])))
    with pytest.raises(InvalidInput, match=r"^tools:"):
        list(model.stream(request(messages=ASK, tools=[WEATHER], tool_choice="required")))
    assert model.decoder.running == [] and not model.decoder.waiting   # refused before it took any KV
    replies = list(model.stream(request(messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=3)))
    assert len(replies) == 3
