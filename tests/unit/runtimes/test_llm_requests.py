"""The llm runtime's pure parts: request parsing, stop strings, the output's text, sampling, the contract.

No engine here: `Output` gets a fake `piece` function (token id -> bytes) and `Sampler` plain numpy logits.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.exceptions import SecurityError

from ember.errors import ContractInvalid, InvalidInput, ModelNotReady
from ember.runtimes import KNOWN_RUNTIMES, get_runtime
from ember.runtimes.llm import LLMModel, LLMOptions, LLMRuntime, compile_template
from ember.runtimes.llm_output import Output
from ember.runtimes.llm_request import StopText
from ember.runtimes.llm_sampling import Choice, Sampler, log_softmax
from ember.runtimes.llm_tools import HERMES
from ember.wire.contract import example_contracts_dir, load_contract, parse_contract
from ember.wire.generation import FIELDS, Message, Request, parse_request
from ember.wire.tensors import validate_inputs, warmup_inputs

SMOLLM2 = load_contract(example_contracts_dir() / "smollm2.yaml")
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


def parse(obj: Any) -> Request:
    return parse_request(json.dumps(obj).encode())


# --- requests ----------------------------------------------------------------------------------


def test_a_full_request_parses() -> None:
    req = parse({"messages": CHAT, "max_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "x"})
    assert req.messages == (Message("system", "be brief"), Message("user", "hi")) and req.prompt is None
    assert (req.max_tokens, req.temperature, req.top_p, req.seed, req.stop) == (7, 0.0, 0.5, 3, ("x",))
    assert req.field == "messages"
    plain = parse({"prompt": "Once upon"})
    assert plain.prompt == "Once upon" and plain.field == "prompt"
    assert (plain.max_tokens, plain.temperature, plain.top_p, plain.seed, plain.stop) == (None, 1.0, 1.0, None, ())
    assert (plain.logit_bias, plain.logprobs, plain.top_logprobs, plain.echo) == ((), False, 0, False)
    assert (plain.tools, plain.tool_choice, plain.response_format, plain.calls_tools) == ((), "auto", None, False)
    assert parse({"prompt": "", "seed": -1}).seed == 2**64 - 1   # any integer seeds the 64-bit generator


def test_null_is_the_default_for_every_optional_field() -> None:
    optional = [f for f in FIELDS if f not in ("messages", "prompt")]
    assert parse({"prompt": "a", **dict.fromkeys(optional)}) == Request(prompt="a")
    assert parse({"messages": CHAT, "prompt": None}).messages == parse({"messages": CHAT}).messages


def test_the_new_fields_parse() -> None:
    req = parse({"prompt": "a", "logit_bias": {"12": -100, "7": 2.5}, "logprobs": True, "top_logprobs": 3,
                 "echo": True, "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "x", "schema": {"type": "object"}}}})
    assert req.logit_bias == ((12, -100.0), (7, 2.5)) and req.logprobs and req.top_logprobs == 3 and req.echo
    assert req.response_format == {"type": "json_schema", "schema": {"type": "object"}}
    assert parse({"prompt": "a", "response_format": {"type": "text"}}).response_format is None
    assert parse({"prompt": "a", "response_format": {"type": "json_object"}}).response_format == \
        {"type": "json_object"}
    tools = parse({"messages": CHAT, "tools": [WEATHER]})
    assert tools.tools == (WEATHER,) and tools.tool_choice == "auto" and tools.calls_tools
    assert not parse({"messages": CHAT, "tools": [WEATHER], "tool_choice": "none"}).calls_tools
    assert parse({"messages": CHAT, "tools": [WEATHER], "tool_choice": "required"}).tool_choice == "required"
    named = parse({"messages": CHAT, "tools": [WEATHER],
                   "tool_choice": {"type": "function", "function": {"name": "weather"}}})
    assert named.tool_choice == {"type": "function", "function": {"name": "weather"}}
    # A tool without "type" is a function; one without parameters takes any object.
    assert parse({"messages": CHAT, "tools": [{"function": {"name": "f"}}]}).tools == \
        ({"type": "function", "function": {"name": "f"}},)


def test_tool_messages_and_an_assistant_that_only_calls_tools() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    req = parse({"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
                              {"role": "tool", "content": "rain", "tool_call_id": "call_1", "name": "weather"}],
                 "tools": [WEATHER]})
    assert req.messages is not None
    assistant, tool = req.messages[2], req.messages[3]
    assert assistant.content is None and assistant.tool_calls == (call,)
    assert (tool.role, tool.content, tool.tool_call_id, tool.name) == ("tool", "rain", "call_1", "weather")
    # The template sees "" for a null content and the arguments as an object (HF's convention).
    shown = assistant.for_template()
    assert shown["content"] == "" and shown["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert tool.for_template() == {"role": "tool", "content": "rain", "tool_call_id": "call_1", "name": "weather"}
    # A call without an id gets one; arguments that are not JSON reach the template as they are.
    bare = parse({"messages": [{"role": "assistant", "content": None,
                                "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]}]})
    assert bare.messages is not None
    assert bare.messages[0].tool_calls[0]["id"] == "call_0"
    assert bare.messages[0].for_template()["tool_calls"][0]["function"]["arguments"] == "not json"
    assert parse({"messages": [{"role": "assistant", "content": None}]}).messages == (Message("assistant", None),)


@pytest.mark.parametrize(("body", "message"), [
    (b"\xff{}", "request: not valid UTF-8"),
    (b"{nope", "request: not valid JSON"),
    (b"[1, 2]", "request: must be a JSON object"),
    (b'{"prompt": "a", "n": 2}', "n: unknown field"),
    (b"{}", "messages: give either messages or prompt"),
    (b'{"prompt": null}', "messages: give either messages or prompt"),
    (b'{"prompt": "a", "messages": []}', "messages: give either messages or prompt, not both"),
    (b'{"prompt": 3}', "prompt: must be a string"),
    (b'{"messages": []}', "messages: must be a non-empty list"),
    (b'{"messages": "hi"}', "messages: must be a non-empty list"),
    (b'{"messages": ["hi"]}', "messages[0]: must be an object"),
    (b'{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, '
     b'{"role": "robot", "content": "c"}]}', "messages[2].role: must be one of system, user, assistant, tool"),
    (b'{"messages": [{"role": "user"}]}', "messages[0].content: must be a string"),
    (b'{"messages": [{"role": "user", "content": null}]}', "messages[0].content: must be a string"),
    (b'{"messages": [{"role": "tool", "content": null}]}', "messages[0].content: must be a string"),
    (b'{"messages": [{"role": "assistant", "content": 3}]}', "messages[0].content: must be a string or null"),
    (b'{"messages": [{"role": "user", "content": "a", "weight": 1}]}', "messages[0].weight: unknown field"),
    (b'{"messages": [{"role": "tool", "content": "a", "tool_call_id": 3}]}',
     "messages[0].tool_call_id: must be a string"),
    (b'{"messages": [{"role": "tool", "content": "a", "name": ["f"]}]}', "messages[0].name: must be a string"),
    (b'{"messages": [{"role": "user", "content": "a", "tool_calls": [{"function": {"name": "f"}}]}]}',
     "messages[0].tool_calls: only an assistant message calls tools"),
    (b'{"messages": [{"role": "assistant", "content": null, "tool_calls": {"name": "f"}}]}',
     "messages[0].tool_calls: must be a list"),
    (b'{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"function": {"arguments": "{}"}}]}]}',
     "messages[0].tool_calls[0]: must be {id, type: function, function: {name, arguments}}"),
    (b'{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", '
     b'"arguments": 3}}]}]}', "messages[0].tool_calls[0]: must be"),
    (b'{"prompt": "a", "max_tokens": 0}', "max_tokens: must be at least 1"),
    (b'{"prompt": "a", "max_tokens": 1.5}', "max_tokens: must be an integer"),
    (b'{"prompt": "a", "max_tokens": true}', "max_tokens: must be an integer"),
    (b'{"prompt": "a", "temperature": 2.5}', "temperature: must be a number from 0 to 2"),
    (b'{"prompt": "a", "temperature": NaN}', "temperature: must be a number from 0 to 2"),
    (b'{"prompt": "a", "temperature": "hot"}', "temperature: must be a number from 0 to 2"),
    (b'{"prompt": "a", "top_p": 0}', "top_p: must be a number greater than 0 and at most 1"),
    (b'{"prompt": "a", "top_p": 1.01}', "top_p: must be a number greater than 0 and at most 1"),
    (b'{"prompt": "a", "seed": "x"}', "seed: must be an integer"),
    (b'{"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}', "stop: must be a string or a list of at most 4"),
    (b'{"prompt": "a", "stop": [1]}', "stop: must be a string or a list"),
    (b'{"prompt": "a", "stop": ["a", ""]}', "stop[1]: must be 1 to 256 characters"),
    (b'{"prompt": "a", "logit_bias": [1, 2]}', "logit_bias: must be an object of at most 300 token ids"),
    (b'{"prompt": "a", "logit_bias": {' + b", ".join(b'"%d": 1' % i for i in range(301)) + b"}}",
     "logit_bias: must be an object of at most 300"),
    (b'{"prompt": "a", "logit_bias": {"x": 1}}', "logit_bias.x: keys must be token ids"),
    (b'{"prompt": "a", "logit_bias": {"-3": 1}}', "logit_bias.-3: keys must be token ids"),
    (b'{"prompt": "a", "logit_bias": {"99999999999999999999": 1}}',   # once an OverflowError in the sampler
     "logit_bias.99999999999999999999: keys must be token ids"),
    (b'{"prompt": "a", "logit_bias": {"3": 101}}', "logit_bias.3: must be a number from -100 to 100"),
    (b'{"prompt": "a", "logit_bias": {"3": true}}', "logit_bias.3: must be a number from -100 to 100"),
    (b'{"prompt": "a", "logprobs": 1}', "logprobs: must be true or false"),
    (b'{"prompt": "a", "echo": "yes"}', "echo: must be true or false"),
    (b'{"messages": [{"role": "user", "content": "a"}], "echo": true}', "echo: only with a prompt"),
    (b'{"prompt": "a", "logprobs": true, "top_logprobs": 21}', "top_logprobs: must be 0 to 20"),
    (b'{"prompt": "a", "logprobs": true, "top_logprobs": -1}', "top_logprobs: must be 0 to 20"),
    (b'{"prompt": "a", "logprobs": true, "top_logprobs": 1.0}', "top_logprobs: must be an integer"),
    (b'{"prompt": "a", "top_logprobs": 2}', "top_logprobs: needs logprobs: true"),
    (b'{"prompt": "a", "logprobs": false, "top_logprobs": 2}', "top_logprobs: needs logprobs: true"),
    (b'{"prompt": "a", "tools": {"name": "f"}}', "tools: must be a list"),
    (b'{"prompt": "a", "tools": ["f"]}', "tools[0]: must be {type: function"),
    (b'{"prompt": "a", "tools": [{"type": "code_interpreter", "function": {"name": "f"}}]}', "tools[0]: must be"),
    (b'{"prompt": "a", "tools": [{"type": "function", "function": {"name": ""}}]}',
     "tools[0].function.name: must be a non-empty string"),
    (b'{"prompt": "a", "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}',
     "tools[0].function.parameters: must be a JSON schema object"),
    (b'{"prompt": "a", "tool_choice": "always"}', "tool_choice: must be none, auto, required or"),
    (b'{"prompt": "a", "tool_choice": {"type": "function"}}', "tool_choice: must be none, auto, required or"),
    (b'{"prompt": "a", "tools": [{"function": {"name": "f"}}], "tool_choice": {"function": {"name": "g"}}}',
     "tool_choice: names 'g', which is not among tools"),
    (b'{"prompt": "a", "response_format": "json"}', "response_format.type: must be text, json_object or"),
    (b'{"prompt": "a", "response_format": {"type": "xml"}}', "response_format.type: must be text, json_object"),
    (b'{"prompt": "a", "response_format": {"type": "json_schema"}}',
     "response_format.json_schema: must be {name, schema}"),
    (b'{"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}',
     "response_format.json_schema: must be {name, schema}"),
])
def test_bad_requests_name_the_field(body: bytes, message: str) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_request(body)
    assert str(err.value).startswith(message), str(err.value)


def _nested(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8), _nested,
                     max_leaves=12)
_names = st.sampled_from(["f", "g", ""]) | _json
_function = st.dictionaries(st.sampled_from(["name", "arguments", "parameters", "description"]),
                            _names | st.just("{}") | st.just({"type": "object"}), max_size=3)
_call = st.dictionaries(st.sampled_from(["id", "type", "function"]), _function | _json, max_size=3)
_messages = st.lists(st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls", "tool_call_id", "x"]),
                                     st.sampled_from(["user", "system", "assistant", "tool", ""]) | _json
                                     | st.lists(_call, max_size=2),
                                     max_size=4), max_size=4)
_tools = st.lists(st.dictionaries(st.sampled_from(["type", "function"]), st.just("function") | _function | _json,
                                  max_size=2), max_size=3)
_tool_choice = st.sampled_from(["none", "auto", "required", "any"]) | st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": _names})}) | _json
_formats = st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])},
                                 optional={"json_schema": st.dictionaries(st.sampled_from(["name", "schema"]),
                                                                          _json, max_size=2)})
_biases = st.dictionaries(st.integers(-5, 2**70).map(str) | st.text(max_size=4), _json | st.floats(-150, 150),
                          max_size=4)
_values = {"messages": _messages, "tools": _tools, "tool_choice": _tool_choice, "response_format": _formats,
           "logit_bias": _biases, "top_logprobs": st.integers(-2, 25), "logprobs": st.booleans(),
           "echo": st.booleans()}
_requests = st.dictionaries(st.sampled_from([*FIELDS, "n", ""]), _json, max_size=6).flatmap(
    lambda base: st.fixed_dictionaries({}, optional={k: v for k, v in _values.items()}).map(
        lambda extra: {**base, **extra}))
# Prefixes an InvalidInput may start with: a field, an element of one, or a key within one.
_NAMED = tuple(f"{key}{sep}" for key in (*FIELDS, "request") for sep in (":", "[", "."))


@settings(max_examples=500, deadline=None)
@given(obj=_requests | _json)
def test_any_json_is_a_request_or_an_invalid_input_naming_a_field(obj: Any) -> None:
    try:
        req = parse(obj)
    except InvalidInput as err:
        message = str(err)
        named = [*_NAMED, *(f"{key}: unknown field" for key in obj)] if isinstance(obj, dict) else list(_NAMED)
        assert any(message.startswith(prefix) for prefix in named), message
        return
    assert (req.messages is None) != (req.prompt is None)
    assert 0 <= req.temperature <= 2 and 0 < req.top_p <= 1 and len(req.stop) <= 4
    assert req.max_tokens is None or req.max_tokens >= 1
    assert 0 <= req.top_logprobs <= 20 and (req.logprobs or not req.top_logprobs)
    assert all(token >= 0 and -100 <= bias <= 100 for token, bias in req.logit_bias)
    Sampler(req.temperature, req.top_p, req.seed, logit_bias=dict(req.logit_bias))   # any request's sampler
    assert all(t["function"]["name"] for t in req.tools)
    assert not (req.echo and req.messages is not None)
    for turn in req.messages or ():   # what the template is given is plain data
        json.dumps(turn.for_template())


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=64))
def test_any_bytes_are_a_request_or_an_invalid_input(raw: bytes) -> None:
    with contextlib.suppress(InvalidInput):
        parse_request(raw)


def test_the_context_bounds_max_tokens_and_the_default_is_capped() -> None:
    model = SimpleNamespace(context=8192, options=LLMOptions(default_max_tokens=512))
    assert LLMModel.budget(model, parse({"prompt": "a"}), 12) == 512       # type: ignore[arg-type]
    assert LLMModel.budget(model, parse({"prompt": "a"}), 8000) == 192     # type: ignore[arg-type]
    assert LLMModel.budget(model, parse({"prompt": "a", "max_tokens": 8180}), 12) == 8180  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=r"^max_tokens: 9000 exceeds the context of 8192 tokens less the "
                                           r"prompt's 12 \(at most 8180\)"):
        LLMModel.budget(model, parse({"prompt": "a", "max_tokens": 9000}), 12)  # type: ignore[arg-type]


def test_the_contracts_max_tokens_caps_the_request() -> None:
    assert parse_request(b'{"prompt": "a", "max_tokens": 8}', max_tokens=8).max_tokens == 8
    with pytest.raises(InvalidInput, match=r"^max_tokens: 9 exceeds the limit of 8 \(the contract's limits"):
        parse_request(b'{"prompt": "a", "max_tokens": 9}', max_tokens=8)


# --- stop strings ------------------------------------------------------------------------------


def stream_cut(chunks: list[str], stops: tuple[str, ...]) -> tuple[list[str], bool]:
    cut, out = StopText(stops), []
    for chunk in chunks:
        piece, stopped = cut.push(chunk)
        out.append(piece)
        if stopped:
            return out, True
    out.append(cut.flush())
    return out, False


def test_text_is_cut_before_a_stop_string_split_over_chunks() -> None:
    out, stopped = stream_cut(["Hel", "lo ST", "OP and more"], ("STOP",))
    assert stopped and "".join(out) == "Hello " and out[1] == "lo "   # "ST" was held back, then dropped
    out, stopped = stream_cut(["a S", "Tx"], ("STOP",))
    assert not stopped and out == ["a ", "STx", ""]                  # a false start is released
    out, stopped = stream_cut(["one\n\ntwo"], ("two", "\n\n"))
    assert stopped and out == ["one"]                                 # the first completed stop wins
    assert stream_cut(["aba"], ("b", "aba")) == stream_cut(["ab", "a"], ("b", "aba")) == (["a"], True)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30), cuts=st.lists(st.integers(0, 30), max_size=6),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), min_size=1, max_size=4))
def test_streamed_cutting_equals_cutting_the_whole_text(text: str, cuts: list[int], stops: list[str]) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    out, stopped = stream_cut(chunks, tuple(stops))
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]   # the first to be completed wins
    assert "".join(out) == (text[: min(hits)[1]] if hits else text)
    assert stopped == bool(hits)


# --- the output: token bytes to whole characters, stops, tool calls, logprobs ---------------------


EOS = 0


class Pieces:
    """A fake vocabulary: token i stands for the i-th byte string it was given (0 is EOS, no bytes)."""

    def __init__(self) -> None:
        self.table: list[bytes] = [b""]

    def tokens(self, chunks: list[bytes]) -> list[int]:
        out = []
        for chunk in chunks:
            self.table.append(chunk)
            out.append(len(self.table) - 1)
        return out

    def __call__(self, token: int) -> bytes:
        return self.table[token]


def run_output(chunks: list[bytes], *, end: str = "length", stops: tuple[str, ...] = (), **kwargs: Any) -> list[Any]:
    """Push each chunk as one token; the last is the budget's last (`end` "length") or an EOS follows ("stop")."""
    pieces = Pieces()
    ids = pieces.tokens(chunks)
    output = Output(pieces, frozenset({EOS}), stops, **kwargs)
    if end == "stop":
        ids.append(EOS)
    out = []
    for i, token in enumerate(ids):
        piece = output.push(Choice(token), end == "length" and i == len(ids) - 1)
        out.append(piece)
        if piece.finish:
            break
    return out


def split_bytes(text: str, cuts: list[int]) -> list[bytes]:
    raw = text.encode()
    bounds = sorted({0, len(raw), *(min(c, len(raw)) for c in cuts)})
    return [raw[a:b] for a, b in itertools.pairwise(bounds)]


def test_multibyte_characters_split_over_tokens_come_out_whole() -> None:
    text = "é日🎉!"
    out = run_output([bytes([b]) for b in text.encode()])
    assert [len(p.text.encode()) for p in out] == [0, 2, 0, 0, 3, 0, 0, 0, 4, 1]
    assert "".join(p.text for p in out) == text
    assert [p.finish for p in out] == [""] * 9 + ["length"]


@settings(max_examples=300, deadline=None)
@given(text=st.text(min_size=1, max_size=20), cuts=st.lists(st.integers(0, 80), max_size=12),
       end=st.sampled_from(["length", "stop"]))
def test_output_pieces_are_whole_characters_and_join_to_the_whole(text: str, cuts: list[int], end: str) -> None:
    out = run_output(split_bytes(text, cuts), end=end)
    assert "".join(p.text for p in out) == text
    assert all("\ufffd" not in p.text for p in out) or "\ufffd" in text   # no half character was decoded
    assert out[-1].finish == end and all(not p.finish for p in out[:-1])


def test_bytes_that_are_not_utf8_become_replacement_characters_at_the_end() -> None:
    out = run_output([b"ok", b"\xe6\x97"], end="stop")   # a truncated character, then EOS
    assert "".join(p.text for p in out) == "ok\ufffd" and out[-1].finish == "stop"


def test_a_stop_string_across_tokens_ends_the_output_before_it() -> None:
    out = run_output([b"Hello", b" ST", b"OP", b" more"], stops=("STOP",))
    assert [p.text for p in out] == ["Hello", " ", ""] and out[-1].finish == "stop"   # "ST" held, then cut
    # A false start is released; at the budget's end a held tail is released too.
    out = run_output([b"a S", b"Tx", b" S"], stops=("STOP",))
    assert "".join(p.text for p in out) == "a STx S" and out[-1].finish == "length"
    # A stop string completed by the last token of the budget is still a stop.
    out = run_output([b"a S", b"TOP"], stops=("STOP",))
    assert "".join(p.text for p in out) == "a " and out[-1].finish == "stop"


def test_echo_puts_the_prompt_before_the_first_reply() -> None:
    out = run_output([b"x", b"y"], prefix="The prompt")
    assert [p.text for p in out] == ["The promptx", "y"]
    assert run_output([], end="stop", prefix="P")[0].text == "P"   # even when the first token ends it


def test_tool_call_text_is_held_back_and_parsed_into_calls() -> None:
    call = [b"<tool", b"_call>", b'{"name": "weather", ', b'"arguments": {"city": "Oslo"}}', b"</tool_call>"]
    out = run_output(call, end="stop", tools=HERMES)
    assert [p.text for p in out] == [""] * len(out) and out[-1].finish == "tool_calls"
    assert out[-1].tool_calls is not None and len(out[-1].tool_calls) == 1
    found = out[-1].tool_calls[0]
    assert found["type"] == "function" and found["id"].startswith("call_")
    assert found["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    # Two calls in one answer.
    two = run_output([b'<tool_call>{"name": "a", "arguments": {}}</tool_call>\n',
                      b'<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'], end="stop", tools=HERMES)
    assert [c["function"]["name"] for c in two[-1].tool_calls or []] == ["a", "b"]


def test_with_tools_plain_text_is_sent_as_soon_as_it_cannot_be_a_call() -> None:
    out = run_output([b"Hel", b"lo <tool_call>", b"!"], end="stop", tools=HERMES)
    assert [p.text for p in out] == ["Hel", "lo <tool_call>", "!", ""] and out[-1].finish == "stop"
    assert out[-1].tool_calls is None
    # Held text that does not parse as a call when the output ends is sent as text.
    bad = run_output([b"<tool_", b"call>not json"], end="stop", tools=HERMES)
    assert "".join(p.text for p in bad) == "<tool_call>not json" and bad[-1].finish == "stop"
    assert bad[-1].tool_calls is None and [p.text for p in bad[:-1]] == ["", ""]
    # The budget's end inside a call that parses: still a tool call.
    cut = run_output([b'<tool_call>{"name": "f", "arguments": {}}'], tools=HERMES)
    assert cut[-1].finish == "tool_calls"


def test_logprob_entries_follow_openais_chat_shape() -> None:
    pieces = Pieces()
    a, b = pieces.tokens([b"\xc3\xa9", b"x"])
    output = Output(pieces, frozenset({EOS}), (), logprobs=True)
    piece = output.push(Choice(a, -0.25, ((a, -0.25), (b, -1.5))), False)
    assert piece.logprobs == [{"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9],
                               "top_logprobs": [{"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9]},
                                                {"token": "x", "logprob": -1.5, "bytes": [0x78]}]}]
    end = output.push(Choice(EOS, -0.1), False)
    assert end.finish == "stop" and end.logprobs == []   # EOS has no entry
    assert Output(pieces, frozenset({EOS}), ()).push(Choice(a, -0.25), False).logprobs is None


def test_echoed_prompt_logprobs_lead_the_first_reply() -> None:
    pieces = Pieces()
    ids = pieces.tokens([b"A", b"B", b"C"])
    output = Output(pieces, frozenset({EOS}), (), logprobs=True, prefix="ABC")
    logits = np.zeros((3, len(pieces.table)), dtype=np.float32)
    logits[0, ids[1]] = 5.0   # after A, B is likely
    output.prompt_logits(ids, 0, logits[:2])
    first = output.push(Choice(ids[2], -1.0), False)
    assert first.text == "ABCC" and first.logprobs is not None
    assert [e["token"] for e in first.logprobs] == ["A", "B", "C", "C"]
    assert first.logprobs[0]["logprob"] is None
    assert first.logprobs[1]["logprob"] == pytest.approx(float(log_softmax(logits[0])[ids[1]]))
    assert first.logprobs[2]["logprob"] == pytest.approx(float(log_softmax(logits[1])[ids[2]]))
    assert first.logprobs[1]["logprob"] > first.logprobs[2]["logprob"]
    assert output.push(Choice(ids[0], -2.0), False).logprobs == [
        {"token": "A", "logprob": -2.0, "bytes": [65], "top_logprobs": []}]
    # A prompt fed in chunks: the chunk starting at 1 adds the entries after it, never the first again.
    chunked = Output(pieces, frozenset({EOS}), (), logprobs=True)
    chunked.prompt_logits(ids, 0, logits[:1])
    chunked.prompt_logits(ids, 1, logits[1:2])
    assert [e["token"] for e in chunked.prompt_entries] == ["A", "B", "C"]


# --- sampling ----------------------------------------------------------------------------------


LOGITS = np.linspace(0, 3, 500, dtype=np.float32)


def draws(seed: int | None, n: int = 20, temperature: float = 1.0, top_p: float = 1.0,
          logits: np.ndarray = LOGITS, **kwargs: Any) -> list[int]:
    sampler = Sampler(temperature, top_p, seed, **kwargs)
    return [sampler.pick(logits).token for _ in range(n)]


def test_the_same_seed_draws_the_same_tokens_and_other_seeds_differ() -> None:
    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert draws(2**64 - 1) == draws(2**64 - 1)
    assert draws(None) != draws(None)   # no seed: the OS's entropy


def test_sampling_never_touches_the_global_rngs() -> None:
    np.random.seed(0)
    random.seed(0)
    expected = (np.random.random(3).tolist(), random.random())
    np.random.seed(0)
    random.seed(0)
    draws(1, n=50)
    draws(None, n=50, top_p=0.5)
    assert (np.random.random(3).tolist(), random.random()) == expected


def test_temperature_zero_and_a_tiny_top_p_are_greedy() -> None:
    logits = np.array([0.0, 5.0, 1.0, 4.9], dtype=np.float32)
    assert Sampler(0.0, 1.0, None).pick(logits).token == 1
    assert Sampler(0.0, 1.0, None).rng is None   # greedy draws nothing
    assert set(draws(3, temperature=0.0)) == {499}
    assert set(draws(3, top_p=1e-6)) == {499}
    nucleus = set(draws(4, n=200, top_p=0.02))
    assert nucleus <= set(range(480, 500)) and len(nucleus) > 1


def test_a_low_temperature_sharpens_and_a_high_one_flattens() -> None:
    logits = np.array([0.0, 1.0, 2.0], dtype=np.float32)
    cold = draws(5, n=400, temperature=0.1, logits=logits)
    hot = draws(5, n=400, temperature=2.0, logits=logits)
    assert cold.count(2) > 390 and hot.count(2) < 300 and hot.count(0) > 20


def test_logit_bias_moves_the_argmax_and_ids_beyond_the_vocabulary_are_ignored() -> None:
    logits = np.array([0.0, 5.0, 1.0, 4.9], dtype=np.float32)
    assert Sampler(0.0, 1.0, None, logit_bias={1: -100.0}).pick(logits).token == 3
    assert Sampler(0.0, 1.0, None, logit_bias={2: 10.0}).pick(logits).token == 2
    assert Sampler(0.0, 1.0, None, logit_bias={2: 10.0, 99: 100.0}).pick(logits).token == 2
    assert set(draws(9, n=50, logits=logits, logit_bias={1: -100.0, 3: -100.0, 0: -100.0})) == {2}
    assert np.array_equal(logits, np.array([0.0, 5.0, 1.0, 4.9], dtype=np.float32))   # not changed in place


def test_logprobs_are_the_models_distribution_and_top_ones_come_in_order() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(1000).astype(np.float32) * 3
    choice = Sampler(0.7, 1.0, 11, logprobs=True, top_logprobs=5).pick(logits)
    lp = log_softmax(logits)
    assert np.exp(lp).sum() == pytest.approx(1.0)
    assert choice.logprob == pytest.approx(float(lp[choice.token]))   # at temperature 1, whatever the sampling's
    assert [t for t, _ in choice.top] == np.argsort(-lp)[:5].tolist()
    values = [v for _, v in choice.top]
    assert values == sorted(values, reverse=True) and values[0] == pytest.approx(float(lp.max()))
    greedy = Sampler(0.0, 1.0, None, logprobs=True, top_logprobs=1).pick(logits)
    assert greedy.top == ((greedy.token, pytest.approx(greedy.logprob)),)
    assert Sampler(0.0, 1.0, None, logprobs=True).pick(logits).top == ()
    assert Sampler(0.0, 1.0, None).pick(logits).logprob is None


class OnlyEven:
    """A fake grammar: only even tokens, and each accepted token recorded."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def allowed(self, logits: np.ndarray) -> np.ndarray:
        out = np.full(len(logits), -np.inf, dtype=np.float32)
        out[::2] = logits[::2]
        return out

    def accept(self, token: int) -> None:
        self.accepted.append(token)


def test_a_grammar_mask_bounds_every_draw_and_sees_each_token() -> None:
    mask = OnlyEven()
    got = draws(1, n=100, top_p=0.9, mask=mask)
    assert all(t % 2 == 0 for t in got) and mask.accepted == got
    assert Sampler(0.0, 1.0, None, mask=OnlyEven()).pick(LOGITS).token == 498
    choice = Sampler(0.0, 1.0, None, mask=OnlyEven(), logprobs=True).pick(LOGITS)
    assert choice.logprob is not None and choice.logprob > float(log_softmax(LOGITS)[498])   # renormalised
    # Tokens the grammar masks are no alternatives (their -inf once reached the reply's JSON as -Infinity).
    few = Sampler(0.0, 1.0, None, mask=OnlyEven(), logprobs=True, top_logprobs=5).pick(LOGITS[:6])
    assert [t for t, _ in few.top] == [4, 2, 0] and all(np.isfinite(v) for _, v in few.top)


# --- the chat template and the contract --------------------------------------------------------


def test_the_chat_template_renders_with_a_generation_prompt_in_a_sandbox() -> None:
    template = compile_template("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                                "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert template.render(messages=CHAT, add_generation_prompt=True) == "<system>be brief<user>hi<assistant>"
    with pytest.raises(SecurityError, match="unsafe"):
        compile_template("{{ ''.__class__.__mro__ }}").render()
    assert compile_template("{{ tools | tojson }}").render(tools=[{"a": "é"}]) == '[{"a": "é"}]'


def test_the_bundled_contract_follows_the_convention_and_its_warmup_is_a_real_request() -> None:
    assert "llm" in KNOWN_RUNTIMES and isinstance(get_runtime("llm"), LLMRuntime)
    assert SMOLLM2.runtime == "llm" and SMOLLM2.max_batch_size == 1
    assert [o.name for o in SMOLLM2.outputs] == ["text", "finish_reason", "prompt_tokens", "completion_tokens",
                                                 "cached_tokens", "logprobs", "tool_calls"]
    inputs = warmup_inputs(SMOLLM2)
    validate_inputs(SMOLLM2, inputs)
    req = parse_request(bytes(inputs["request"][0]))
    assert req.messages and req.max_tokens is not None and req.max_tokens >= 1 and req.temperature == 0


def variant(**changes: Any) -> Any:
    data = SMOLLM2.model_dump(mode="json", exclude={"source"})
    data.update(changes)
    return parse_contract(data)


REQUIRED_OUTPUTS = [o for o in SMOLLM2.model_dump(mode="json")["outputs"]
                    if o["name"] not in ("cached_tokens", "logprobs", "tool_calls")]


@pytest.mark.parametrize(("changes", "message"), [
    ({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}], "warmup": {"requests": 0}},
     "inputs: the llm runtime takes inputs request"),
    ({"outputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}]}, "outputs: the llm runtime takes outputs"),
    ({"inputs": [{"name": "request", "datatype": "BYTES", "shape": [-1]}], "warmup": {"requests": 0}},
     r"inputs.request: expected BYTES \[1\], got BYTES \[-1\]"),
    ({"outputs": [*SMOLLM2.model_dump(mode="json")["outputs"], {"name": "text", "datatype": "BYTES", "shape": [1]}]},
     r"outputs: the llm runtime takes outputs .* \(and optionally cached_tokens, logprobs, tool_calls\)"),
    ({"outputs": [*REQUIRED_OUTPUTS, {"name": "logprobs", "datatype": "FP32", "shape": [1]}]},
     r"outputs.logprobs: expected BYTES \[1\], got FP32 \[1\]"),
    ({"options": {"dtype": "float16"}}, "options.dtype"),
    ({"options": {"snapshot_encoding": "int4"}}, "options.snapshot_encoding"),
    ({"options": {"max_tokens_in_flight": 0}}, "options.max_tokens_in_flight"),
    ({"options": {"engine": "vllm"}}, "options.engine"),
    ({"options": {"kv_type": "q4_0"}}, "options.kv_type"),
    ({"options": {"step_tokens": 8}}, "options.step_tokens"),
    ({"options": {"kv_tokens": 8}}, "options.kv_tokens"),
    ({"options": {"beams": 4}}, "options.beams"),
    ({"weights": "model.bin"}, "weights: the llm runtime needs a .gguf file"),
])
def test_a_contract_off_the_convention_is_refused_before_any_load(changes: dict[str, Any], message: str) -> None:
    runtime = LLMRuntime(cache_root=None)
    with pytest.raises(ContractInvalid, match=message):
        runtime.load(variant(**changes))


def test_a_contract_without_the_optional_outputs_is_on_the_convention() -> None:
    from ember.runtimes.llm_request import check_convention

    check_convention(variant(outputs=REQUIRED_OUTPUTS), "llm")
    check_convention(variant(outputs=[*REQUIRED_OUTPUTS, {"name": "tool_calls", "datatype": "BYTES", "shape": [1]}]),
                     "llm")


def test_tool_choice_required_without_tools_is_refused_as_by_the_gateway() -> None:
    with pytest.raises(InvalidInput, match=r"^tool_choice: 'required' needs tools"):
        parse_request(b'{"prompt": "a", "tool_choice": "required"}')
    assert parse_request(b'{"prompt": "a", "tool_choice": "auto"}').tool_choice == "auto"


def test_missing_weights_and_store_weights_without_a_store_are_not_ready() -> None:
    with pytest.raises(ModelNotReady, match="this node has none configured"):
        LLMRuntime(cache_root=None).load(variant(weights="store:smollm2:1"))
    with pytest.raises(ModelNotReady, match="does not exist"):
        LLMRuntime(cache_root=None).load(variant(weights="/nonexistent/model.gguf"))
