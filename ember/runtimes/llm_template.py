"""The chat template a generative model renders `messages` (and `tools`) with: the model's own, or the contract's.

A GGUF carries its template in `tokenizer.chat_template` and a Hugging Face directory in its tokenizer's config;
a base-model conversion carries none, and some carry one that renders no tools. A contract may give its own, as
llama.cpp's server and vLLM take `--chat-template`: inline (`options.chat_template`) or in a file beside the
contract (`options.chat_template_file`, relative to the contract's directory, or absolute). It replaces the model's
for everything that renders messages: the warm-up, chat, tools and the gateway's prompt check.

The tool-call format is read from the template (ember.runtimes.llm_tools.tool_format) unless
`options.tool_format` names it (`none`: the model calls no tools, whatever its template says).

Both are read and checked once, when the model loads (a template's syntax too): ContractInvalid naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ember.errors import ContractInvalid
from ember.runtimes.llm_tools import HERMES, JSON, LLAMA3, MISTRAL, ToolFormat, tool_format
from ember.wire.contract import ModelContract

TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, JSON)}
MAX_TEMPLATE_BYTES = 1 << 20   # a chat template file larger than this is not one
NO_TEMPLATE = ("messages: the model has no chat template (send a prompt instead, or give its contract one: "
               "options.chat_template or options.chat_template_file)")


class TemplateOptions(BaseModel):
    """The contract `options` both generative runtimes (llm, vllm) take for the chat template."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chat_template: str | None = Field(default=None, min_length=1, max_length=MAX_TEMPLATE_BYTES)
    chat_template_file: str | None = Field(default=None, min_length=1)
    tool_format: Literal["auto", "hermes", "llama3", "mistral", "json", "none"] = "auto"


def compile_template(source: str) -> Any:
    """A chat template in a sandboxed jinja2 environment set up as transformers sets it up."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def contract_template(contract: ModelContract, options: TemplateOptions) -> str | None:
    """The contract's own chat template (None: it gives none, the model's is used), read and its syntax checked;
    ContractInvalid naming the key otherwise."""
    where = f"model '{contract.key}'"
    if options.chat_template is not None and options.chat_template_file is not None:
        raise ContractInvalid(f"{where}: options.chat_template and options.chat_template_file: give one, not both")
    if options.chat_template is not None:
        source, key = options.chat_template, "options.chat_template"
    elif options.chat_template_file is not None:
        source, key = _read(contract, options.chat_template_file), "options.chat_template_file"
    else:
        return None
    from jinja2 import TemplateSyntaxError

    try:
        compile_template(source)
    except TemplateSyntaxError as err:
        raise ContractInvalid(f"{where}: {key}: not a valid jinja2 template: {err.message} (line {err.lineno})") \
            from None
    return source


def template_path(contract: ModelContract, name: str) -> Path:
    """`options.chat_template_file` as a path: absolute, or relative to the contract's directory."""
    path = Path(name).expanduser()
    if not path.is_absolute() and contract.source:
        path = Path(contract.source).parent / path
    return path


def _read(contract: ModelContract, name: str) -> str:
    path = template_path(contract, name)
    where = f"model '{contract.key}': options.chat_template_file"
    if not path.is_absolute():
        raise ContractInvalid(f"{where}: {name!r} is relative and the contract was not read from a file "
                              "(give an absolute path, or the template inline in options.chat_template)")
    try:
        with path.open("rb") as f:
            data = f.read(MAX_TEMPLATE_BYTES + 1)
    except OSError as err:
        raise ContractInvalid(f"{where}: cannot read {str(path)!r}: {err.strerror or err}") from None
    if len(data) > MAX_TEMPLATE_BYTES:
        raise ContractInvalid(f"{where}: {str(path)!r} is larger than {MAX_TEMPLATE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ContractInvalid(f"{where}: {str(path)!r} is not UTF-8 (byte {err.start})") from None
    if not text.strip():
        raise ContractInvalid(f"{where}: {str(path)!r} is empty")
    return text


def template_tool_format(options: TemplateOptions, source: str | None) -> ToolFormat | None:
    """The tool-call format: the one `options.tool_format` names, else the one the template teaches (None: the
    model calls no tools; a request with tools is refused)."""
    if options.tool_format == "none":
        return None
    if options.tool_format == "auto":
        return tool_format(source)
    return TOOL_FORMATS[options.tool_format]
