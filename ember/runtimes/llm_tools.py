"""Tool calls and structured output in text: the formats chat templates teach models, and grammars (GBNF).

A model calls tools in the format its chat template describes: Hermes/Qwen wrap a JSON object in
`<tool_call>...</tool_call>`, Llama 3.1+ answer a bare `{"name": ..., "parameters": ...}`, Mistral writes
`[TOOL_CALLS]` and a JSON list. `tool_format` reads which from the template (None: the template renders no
tools, and a request with tools is refused). `ToolFormat.parse` turns a finished generation into OpenAI's
`tool_calls`; `may_start` says whether text could still become one (the output holds it back meanwhile).

Grammars: `tool_choice` `required` (or one named function) constrains the output to a call of the format, and
`response_format` `json_object`/`json_schema` to JSON: through llama.cpp's GBNF, from llama-cpp-python's
JSON-schema converter, or on vLLM through its structured outputs (xgrammar), from the same schemas and framing.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ember.errors import InvalidInput

if TYPE_CHECKING:
    from ember.wire.generation import Request


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str          # text before a call ("" for a bare JSON object)
    close: str         # text after it
    arguments: str     # the key holding the arguments
    listed: bool = False   # the calls are one JSON list after `open`

    def may_start(self, text: str) -> bool:
        s = text.lstrip()
        lead = self.open or "{"
        return s == "" or lead.startswith(s) or s.startswith(lead)

    def parse(self, text: str, names: frozenset[str] | None = None) -> list[dict[str, Any]]:
        """OpenAI tool calls found in `text` (empty: it is not a call). With `names`, a call must name one of
        them, and a bare JSON object must hold its arguments key: `{"name": "Bob", "age": 3}` is an answer."""
        objects: list[Any] = []
        s = text.strip()
        if self.listed and s.startswith(self.open):
            objects = _as_list(_loads(s[len(self.open):]))
        elif self.open and self.close:
            pattern = re.escape(self.open) + r"\s*(.*?)\s*(?:" + re.escape(self.close) + r"|$)"
            objects = [_loads(m) for m in re.findall(pattern, s, flags=re.DOTALL)]
        elif s.startswith("{"):
            objects = [_loads(part) for part in re.split(r"\s*;\s*(?=\{)", s)]
        calls = []
        for obj in objects:
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return []
            if names is not None and (obj["name"] not in names or
                                      (not self.open and self.arguments not in obj and "arguments" not in obj)):
                return []
            arguments = obj.get(self.arguments, obj.get("arguments", obj.get("parameters", {})))
            text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                          "function": {"name": obj["name"], "arguments": text}})
        return calls

    def call_schema(self, tools: tuple[dict[str, Any], ...], only: str | None = None) -> dict[str, Any]:
        """JSON schema of one call's object in this format, for these tools (`only`: the one named). The tools'
        parameter definitions (`$defs`, `definitions`: what pydantic and the openai SDK write for nested models,
        referred to as `#/$defs/NAME`) move to the top, where those references then point."""
        options: list[dict[str, Any]] = []
        defs: dict[tuple[str, str], Any] = {}
        for t in tools:
            if only is not None and t["function"]["name"] != only:
                continue
            parameters = t["function"].get("parameters") or {"type": "object"}
            if isinstance(parameters, dict):
                parameters = dict(parameters)
                for key in ("$defs", "definitions"):
                    found = parameters.pop(key, None)
                    for name, value in (found.items() if isinstance(found, dict) else ()):
                        if defs.setdefault((key, name), value) != value:
                            raise InvalidInput(f"tools: two tools' parameters define {key}.{name} differently")
            options.append({"type": "object", "required": ["name", self.arguments],
                            "properties": {"name": {"const": t["function"]["name"]}, self.arguments: parameters}})
        schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
        for (key, name), value in defs.items():
            schema.setdefault(key, {})[name] = value
        return schema

    def framed(self, call_rules: str) -> str:
        """A grammar whose root is one call in this format around `call_rules` (whose root is renamed `call`):
        the same EBNF for llama.cpp's GBNF and vLLM's xgrammar."""
        body = rename_root(call_rules, "call")
        if self.listed:
            return f'root ::= {_literal(self.open)} "[" call "]"\n{body}'
        return f"root ::= {_literal(self.open)} call {_literal(self.close)}\n{body}" if self.open else \
            f"root ::= call\n{body}"

    def grammar(self, tools: tuple[dict[str, Any], ...], only: str | None = None) -> str:
        """GBNF (llama.cpp) for one call of these tools (of `only`, when named), in this format."""
        return self.framed(json_grammar(self.call_schema(tools, only), "tools"))


class ToolCalls:
    """A generation's text as it comes, with tools: text that may begin a tool call is held back until it cannot
    (then it goes out as text, and no call can follow: tools are called before any text) or the generation ends
    (then it is parsed into calls). Without a format (no tools) text passes as it is. The engines' runtimes share
    it: llama.cpp's through `ember.runtimes.llm_output.Output`, vLLM's on the text of its outputs."""

    def __init__(self, fmt: ToolFormat | None, names: frozenset[str] | None = None) -> None:
        self.format, self.names, self.held = fmt, names, ""

    def push(self, text: str) -> str:
        """What of the text so far may go out now."""
        if self.format is None:
            return text
        buf = self.held + text
        if self.format.may_start(buf):
            self.held = buf
            return ""
        self.held, self.format = "", None
        return buf

    def finish(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The generation's last text: the text still to go out, and its calls (then the text is "" and the
        finish reason is `tool_calls`)."""
        whole, self.held = self.held + text, ""
        calls = self.format.parse(whole, self.names) if self.format is not None else []
        return ("", calls) if calls else (whole, [])


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments")
LLAMA3 = ToolFormat("llama3", "", "", "parameters")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "arguments", listed=True)
JSON = ToolFormat("json", "", "", "arguments")


def check_tools(request: Request, fmt: ToolFormat | None) -> None:
    """The tool rules every engine's runtime applies: tools only with messages (the chat template renders them),
    and called only where the model's template teaches a format (`fmt`); else InvalidInput naming `tools`."""
    if request.tools and request.messages is None:
        raise InvalidInput("tools: only with messages (the chat template renders them)")
    if request.calls_tools and fmt is None:
        raise InvalidInput("tools: the model's chat template has no tool format (send tool_choice: none, or no tools)")


def tool_format(template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template teaches, or None when it renders no tools."""
    if not template or not re.search(r"\btools\b", template):
        return None
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template or "[AVAILABLE_TOOLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or '"parameters"' in template:
        return LLAMA3
    return JSON


MAX_SCHEMA_BOUND = 4096       # a bound (maxLength, maxItems...) the converter spells out one repetition at a time
MAX_GRAMMAR_BYTES = 256 << 10


def json_grammar(schema: dict[str, Any] | None, where: str = "response_format.json_schema.schema") -> str:
    """GBNF for JSON matching `schema` (None: any JSON object); InvalidInput naming `where` when it cannot be one,
    or when its bounds would make a grammar of more than MAX_GRAMMAR_BYTES (a request may not cost that)."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    check_schema(schema, where)
    try:
        gbnf = str(json_schema_to_gbnf(json.dumps(schema if schema is not None else {"type": "object"})))
    except (AssertionError, AttributeError, IndexError, ValueError, KeyError, TypeError, RecursionError,
            NotImplementedError) as err:   # the converter asserts and assumes well-formed schemas
        raise InvalidInput(f"{where}: cannot be turned into a grammar: {err}") from None
    if len(gbnf) > MAX_GRAMMAR_BYTES:
        raise InvalidInput(f"{where}: its grammar would take {len(gbnf)} bytes (at most {MAX_GRAMMAR_BYTES})")
    return gbnf


_BOUNDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_ALTERNATIVES = ("anyOf", "oneOf", "allOf", "enum", "type")   # JSON Schema: when an array, at least one item
_DATA = ("const", "default", "examples", "enum")   # their values are data, not schemas: not descended into


def check_schema(schema: Any, where: str, depth: int = 0) -> None:
    """Refuse repetition bounds the converter would spell out term by term (maxLength 10**9: gigabytes), and
    alternatives that allow nothing (`anyOf: []`: a grammar no output satisfies, which ends a reply empty)."""
    if depth > 64:
        raise InvalidInput(f"{where}: nested more than 64 levels")
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in _BOUNDS and isinstance(value, int | float) and value > MAX_SCHEMA_BOUND:
                raise InvalidInput(f"{where}.{key}: {value} exceeds {MAX_SCHEMA_BOUND}")
            if key in _ALTERNATIVES and value == []:
                raise InvalidInput(f"{where}.{key}: an empty list is not allowed (JSON Schema: at least one)")
            if key not in _DATA:   # values, not schemas: `{"default": {"enum": []}}` is a default, not an enum
                check_schema(value, f"{where}.{key}", depth + 1)
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            check_schema(value, f"{where}[{i}]", depth + 1)


def rename_root(gbnf: str, name: str) -> str:
    """The grammar with its rule `root` named `name`, where it is defined and wherever it is referred to (a
    recursive schema refers back to it); literals and character classes untouched."""
    return _RULE_OR_LITERAL.sub(lambda m: m.group(0) if m.group(1) else name, gbnf)


_RULE_OR_LITERAL = re.compile(r'("(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\])|(?<![\w-])root(?![\w-])')


def _literal(text: str) -> str:
    return json.dumps(text)   # GBNF literals take JSON's escapes


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):   # a model can nest deeper than the parser goes
        return None


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
