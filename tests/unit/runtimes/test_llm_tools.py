"""Tool calls and structured output in text: the format a chat template teaches, parsing a model's answer into
OpenAI's tool calls, the hold-back test, and the GBNF grammars (no model: llama.cpp compiles them in
tests/integration/runtimes/test_llm_architectures.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.errors import InvalidInput
from ember.runtimes.llm_tools import (
    HERMES,
    JSON,
    LLAMA3,
    MISTRAL,
    ToolFormat,
    json_grammar,
    rename_root,
    tool_format,
)
from ember.testing.gguf_models import CHATML_TOOLS, TEMPLATES

QWEN = ("{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
        "</tools>\nFor each function call, return a json object within <tool_call></tool_call> XML tags<|im_end|>"
        "{%- endif %}{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>"
        "{% endfor %}")
MISTRAL_TEMPLATE = ("{%- if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
                    "{%- for m in messages %}{% if m.tool_calls %}[TOOL_CALLS] {{ m.tool_calls | tojson }}"
                    "{{ eos_token }}"
                    "{% else %}[INST] {{ m.content }} [/INST]{% endif %}{% endfor %}")
LLAMA31 = ("{%- if tools is not none %}<|start_header_id|>ipython<|end_header_id|>{% endif %}"
           "{%- for m in messages %}{%- if m.tool_calls %}<|python_tag|>{{ m.tool_calls[0].function | tojson }}"
           "{%- endif %}{% endfor %}")
LLAMA32 = ('{%- if tools %}Respond in the format {"name": function name, "parameters": dictionary of argument name '
           "and its value}.{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}")
PLAIN_TOOLS = ("{% if tools %}You can use these tools: {{ tools | tojson }}. Reply with a JSON object naming the "
               "function and its arguments.{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}<|im_start|>system\n"
           "You are a helpful AI assistant named SmolLM<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
           "{{ message['content'] }}<|im_end|>\n{% endfor %}")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"enum": ["Oslo", "Rome"]}},
                                                           "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(("template", "expected"), [
    (QWEN, HERMES),
    (CHATML_TOOLS, HERMES),
    (MISTRAL_TEMPLATE, MISTRAL),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}", MISTRAL),
    (LLAMA31, LLAMA3),
    (LLAMA32, LLAMA3),
    (PLAIN_TOOLS, JSON),
    (SMOLLM2, None),
    (TEMPLATES["phi3"], None),
    ("{% for toolset in toolsets %}{{ toolset }}<tool_call>{% endfor %}", None),   # "tools" as a word only
    ("", None),
    (None, None),
])
def test_the_tool_format_is_read_from_the_chat_template(template: str | None, expected: ToolFormat | None) -> None:
    assert tool_format(template) == expected


def names_and_arguments(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    for call in calls:
        assert call["type"] == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
        assert isinstance(call["function"]["arguments"], str)   # OpenAI's: a string of JSON
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(("fmt", "text", "expected"), [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     [("get_weather", {"city": "Oslo"})]),
    (HERMES, '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
             '{"x": [1, 2]}}</tool_call>', [("a", {}), ("b", {"x": [1, 2]})]),
    (HERMES, '  <tool_call>{"name": "a", "arguments": {"q": "é"}}', [("a", {"q": "é"})]),   # unclosed: the end
    (HERMES, '<tool_call>{"name": "a"}</tool_call>', [("a", {})]),                         # no arguments: {}
    (HERMES, '<tool_call>{"name": "a", "parameters": {"k": 1}}</tool_call>', [("a", {"k": 1})]),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Rome"}}', [("get_weather", {"city": "Rome"})]),
    (LLAMA3, '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": 2}}', [("a", {}), ("b", {"n": 2})]),
    (LLAMA3, '{"name": "a", "arguments": {"n": 3}}', [("a", {"n": 3})]),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", '
              '"arguments": {}}]', [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (MISTRAL, '[TOOL_CALLS][{"name": "a", "arguments": {}}]', [("a", {})]),
    (JSON, '{"name": "get_time", "arguments": {}}', [("get_time", {})]),
])
def test_each_format_parses_its_calls(fmt: ToolFormat, text: str, expected: list[tuple[str, Any]]) -> None:
    calls = fmt.parse(text)
    assert names_and_arguments(calls) == expected
    assert len({c["id"] for c in calls}) == len(calls)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL, JSON])
@pytest.mark.parametrize("text", [
    "", "Hello! How can I help?", "The answer is {\"name\": \"x\"}", "{not json}", '{"arguments": {}}',
    '{"name": 3, "arguments": {}}', "<tool_call>not json</tool_call>", '<tool_call>["a"]</tool_call>',
    "[TOOL_CALLS] nothing", '[TOOL_CALLS] {"name": "a"}', '[TOOL_CALLS] [{"name": "a"}, "b"]',
    '<tool_call>{"name": "a"}</tool_call><tool_call>oops</tool_call>',   # one bad call: it is all text
])
def test_text_that_is_not_a_call_parses_to_nothing(fmt: ToolFormat, text: str) -> None:
    assert fmt.parse(text) == []


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet='<>/[]{}":,; _abcnmeolt1TOLCAS\n', max_size=60),
       fmt=st.sampled_from([HERMES, LLAMA3, MISTRAL, JSON]))
def test_any_text_parses_to_calls_or_nothing(text: str, fmt: ToolFormat) -> None:
    for name, _ in names_and_arguments(fmt.parse(text)):
        assert isinstance(name, str)


@pytest.mark.parametrize(("fmt", "starts", "never"), [
    (HERMES, ["", "  ", "<", "<tool", "<tool_call>", '\n<tool_call>{"name"'], ["Hello", "<tools", "a<tool_call>"]),
    (LLAMA3, ["", "{", ' {"name": "f"', "\n{"], ["Sure", "[", "a{"]),
    (MISTRAL, ["", "[", "[TOOL", "[TOOL_CALLS] [{"], ["[INST]", "Sure", "{"]),
    (JSON, ["", "{", '{"name"'], ["The", "<tool_call>"]),
])
def test_may_start_says_whether_text_can_still_become_a_call(fmt: ToolFormat, starts: list[str],
                                                              never: list[str]) -> None:
    assert all(fmt.may_start(s) for s in starts), [s for s in starts if not fmt.may_start(s)]
    assert not any(fmt.may_start(s) for s in never), [s for s in never if fmt.may_start(s)]


def rules(gbnf: str) -> dict[str, str]:
    found = dict(line.split(" ::= ", 1) for line in gbnf.splitlines() if " ::= " in line)
    assert len(found) == len([line for line in gbnf.splitlines() if " ::= " in line]), "a rule defined twice"
    return found


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL, JSON])
def test_the_tool_grammar_holds_each_tool_and_the_formats_frame(fmt: ToolFormat) -> None:
    gbnf = fmt.grammar((WEATHER, CLOCK))
    found = rules(gbnf)
    assert "root" in found and "call" in found
    assert '\\"get_weather\\"' in gbnf and '\\"get_time\\"' in gbnf and '\\"Oslo\\"' in gbnf
    assert f'\\"{fmt.arguments}\\"' in gbnf
    if fmt is HERMES:
        assert found["root"] == '"<tool_call>" call "</tool_call>"'
    elif fmt is MISTRAL:
        assert found["root"] == '"[TOOL_CALLS]" "[" call "]"'
    else:
        assert found["root"] == "call"
    only = fmt.grammar((WEATHER, CLOCK), only="get_time")
    assert '\\"get_time\\"' in only and "get_weather" not in only
    assert all(re.fullmatch(r"[a-z0-9-]+", name) for name in rules(only))


def test_json_grammars_follow_the_schema_or_any_object() -> None:
    assert "root" in rules(json_grammar(None)) and "object" in json_grammar(None)
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
              "required": ["colour", "n"]}
    gbnf = json_grammar(schema)
    assert '\\"red\\"' in gbnf and '\\"colour\\"' in gbnf and "root" in rules(gbnf)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "http://example.com/s.json"}}},
    {"anyOf": 3},
    {"type": "nonsense"},                          # the converter asserts: once an AssertionError, not a 400
    {"$ref": "#/$defs/missing"},
    {"type": "string", "pattern": "[a-z]+"},       # its patterns must be anchored
    {"properties": "not an object"},               # once an AttributeError
    {"type": "object", "required": 3, "properties": {"a": {}}},
])
def test_a_schema_the_converter_cannot_take_is_invalid_input(schema: dict[str, Any]) -> None:
    with pytest.raises(InvalidInput, match=r"^response_format.json_schema.schema: cannot be turned into a grammar"):
        json_grammar(schema)


@pytest.mark.parametrize(("schema", "where"), [
    ({"anyOf": []}, "anyOf"), ({"type": "object", "properties": {"a": {"oneOf": []}}}, "properties.a.oneOf"),
    ({"allOf": []}, "allOf"), ({"enum": []}, "enum"), ({"type": "object", "properties": {"a": {"type": []}}},
                                                       "properties.a.type"),
])
def test_alternatives_that_allow_nothing_are_invalid_input(schema: dict[str, Any], where: str) -> None:
    """Not a grammar that no output satisfies (on vLLM such a request ended with an empty reply)."""
    with pytest.raises(InvalidInput, match=rf"^response_format.json_schema.schema.{where}: an empty list is not"):
        json_grammar(schema)


def test_values_under_default_const_or_examples_are_data_not_schemas() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "default": {"enum": [], "maxLength": 10**12},
                                                     "examples": [{"anyOf": []}]}}}
    assert "root" in json_grammar(schema)


_KEYS = st.sampled_from(["type", "properties", "items", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "required",
                         "additionalProperties", "pattern", "minLength", "maxLength", "minimum", "maximum",
                         "minItems", "maxItems", "format", "$defs", "prefixItems", "x"])
_LEAVES = st.none() | st.booleans() | st.integers(-3, 5) | st.floats(allow_nan=False) | st.sampled_from(
    ["string", "object", "array", "integer", "number", "boolean", "null", "^a$", "#/$defs/a", "date", "uuid", "a"])
_SCHEMAS = st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(_KEYS | st.text(max_size=3), inner, max_size=4), max_leaves=15)


@settings(max_examples=400, deadline=None)
@given(schema=st.dictionaries(_KEYS, _SCHEMAS, max_size=4))
def test_any_schema_is_a_grammar_or_an_invalid_input(schema: dict[str, Any]) -> None:
    try:
        gbnf = json_grammar(schema)
    except InvalidInput:
        return
    assert "root" in rules(gbnf)


NESTED = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"guest": {"$ref": "#/$defs/Guest"}}, "required": ["guest"],
    "$defs": {"Guest": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}}}


def test_nested_parameter_definitions_move_to_the_call_schemas_top_where_their_references_point() -> None:
    """What pydantic and the openai SDK write for a nested model: `$defs` beside the properties, `#/$defs/...`."""
    schema = HERMES.call_schema((NESTED,))
    assert schema["$defs"] == NESTED["function"]["parameters"]["$defs"]
    assert "$defs" not in schema["properties"]["arguments"]
    assert "Guest" in HERMES.grammar((NESTED,))   # llama-cpp-python's converter resolves the reference
    clash = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "$defs": {"Guest": {"type": "integer"}}}}}
    with pytest.raises(InvalidInput, match=r"^tools: two tools' parameters define \$defs.Guest differently"):
        HERMES.call_schema((NESTED, clash))


def test_renaming_the_root_rule_renames_its_references_and_nothing_else() -> None:
    rules = 'root ::= "{" root-kv "root" [root] root_1 root\nroot-kv ::= root | "x\\"root"\n'
    renamed = 'call ::= "{" root-kv "root" [root] root_1 call\nroot-kv ::= call | "x\\"root"\n'
    assert rename_root(rules, "call") == renamed
