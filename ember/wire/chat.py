"""Wire models of the OpenAI text-generation APIs (`/v1/chat/completions`, `/v1/completions`) and of the KServe
V2 generate extension.

Requests are validated here once (an error's message starts with the field it is about); what an LLM instance
needs of them is the `request` input of the `llm` runtime's convention (`docs/llm-convention.md`): one JSON
object per generation, `generation_requests()` (one per choice: `n` and a list of prompts fan out). `null` for
an optional field means its default. Fields clients send by default and that change nothing here (`user`,
`metadata`, `store`, `service_tier`, `parallel_tool_calls`, `prediction`, ...) are accepted and ignored; what
ember cannot do (audio, images, penalties other than 0, the deprecated `functions`) is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ember.wire import generation
from ember.wire.generation import MAX_TOP_LOGPROBS, TEMPERATURE, TOP_P

Role = Literal["system", "developer", "user", "assistant", "tool"]
MAX_N = 16                 # choices per request (the gateway sends one request per choice)
MAX_PROMPTS = 16           # prompts per completions request
MAX_CHOICES = 64           # prompts x n


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Lenient(BaseModel):
    """A nested object clients fill from their own types: unknown keys are ignored, not refused."""

    model_config = ConfigDict(extra="ignore")


# The sampling fields' rules are the generation request's (`ember.wire.generation`): one message per field whichever
# API it came by. A field checked by them keeps the value sent where the runtime reads it again (`stop`, `seed`,
# `logit_bias`); the Field bounds below state the same constants for the OpenAPI document.
def _seed(seed: Any) -> Any:
    generation.seed(seed)
    return seed


def _stop(stop: Any) -> Any:
    return stop if generation.stops(stop) else None


def _bias(bias: Any) -> Any:
    return bias if generation.logit_bias(bias) else None


_CHECKED: dict[str, Callable[[Any], Any]] = {
    "temperature": generation.temperature, "top_p": generation.top_p, "top_logprobs": generation.top_logprobs,
    "seed": _seed, "stop": _stop, "logit_bias": _bias}


class _SamplingChecks(BaseModel):
    """The sampling fields' checks, for every model that has them."""

    least_tokens: ClassVar[int] = 1   # `max_tokens` at least (the completions API's 0: the prompt's logprobs alone)

    @field_validator(*_CHECKED, mode="before", check_fields=False)
    @classmethod
    def _sampling(cls, value: Any, info: ValidationInfo) -> Any:
        return None if value is None else _CHECKED[str(info.field_name)](value)

    @field_validator("max_tokens", "max_completion_tokens", mode="before", check_fields=False)
    @classmethod
    def _tokens(cls, value: Any, info: ValidationInfo) -> Any:
        least = cls.least_tokens if info.field_name == "max_tokens" else 1
        return None if value is None else generation.max_tokens(value, least)


def _nothing_or(value: Any, field: str, why: str) -> None:
    if value not in (None, [], {}, False):
        raise ValueError(f"{field}: {why}")


# ----------------------------------------------------------------------------------------------------- tools


class FunctionCall(_Lenient):
    name: str = Field(min_length=1, max_length=256)
    arguments: str


class ToolCall(_Lenient):
    """An assistant message's call, as OpenAI returned it and the client sends it back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


# --------------------------------------------------------------------------------------------- response_format


class JsonSchemaFormat(_Lenient):
    name: str = Field(default="response", min_length=1, max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: required with type 'json_schema'")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError("json_schema: only with type 'json_schema'")
        return self

    def wire(self) -> dict[str, Any] | None:
        """The convention's `response_format`, or None for text (the default)."""
        if self.type == "text":
            return None
        if self.json_schema is None:
            return {"type": self.type}
        spec: dict[str, Any] = {"name": self.json_schema.name,
                                "schema": self.json_schema.schema_ if self.json_schema.schema_ is not None
                                else {"type": "object"}}
        if self.json_schema.strict is not None:
            spec["strict"] = self.json_schema.strict
        return {"type": "json_schema", "json_schema": spec}


# -------------------------------------------------------------------------------------------------- messages


def _joined_parts(parts: list[Any]) -> str:
    """OpenAI's content parts as one string: text parts joined by newlines (as vLLM does); others refused."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "input_text"):
            raise ValueError(f"content[{j}].type: {kind!r} is not supported (only text parts)")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"content[{j}].text: must be a string")
        texts.append(text)
    return "\n".join(texts)


class ChatMessage(_Strict):
    role: Role
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None           # an assistant message sent back as the client got it: ignored
    annotations: list[Any] | None = None
    reasoning_content: str | None = None
    audio: Any = None
    function_call: Any = None

    @model_validator(mode="before")
    @classmethod
    def _parts(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            return {**data, "content": _joined_parts(data["content"])}
        return data

    @model_validator(mode="after")
    def _by_role(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: required in a {self.role} message (null only for an assistant's)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only in an assistant message")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: required in a tool message")
        _nothing_or(self.audio, "audio", "audio is not supported")
        _nothing_or(self.function_call, "function_call", "deprecated by OpenAI and not supported: send tool_calls")
        return self

    def wire(self) -> dict[str, Any]:
        """The convention's message: `developer` is `system`; `name` only for a tool's answer."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
            if self.name:
                out["name"] = self.name
        return out


# -------------------------------------------------------------------------------------------------- requests


class StreamOptions(_Lenient):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None


class _Request(_Strict, _SamplingChecks):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=TEMPERATURE[0], le=TEMPERATURE[1])
    top_p: float | None = Field(default=None, gt=TOP_P[0], le=TOP_P[1])
    seed: int | None = None
    stop: Any = None
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    user: str | None = None                                   # accepted and ignored, as by OpenAI's other peers
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="after")
    def _common(self) -> _Request:
        for key in ("frequency_penalty", "presence_penalty"):
            if getattr(self, key):
                raise ValueError(f"{key}: not supported (only 0)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        return self

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)

    def sampling(self) -> dict[str, Any]:
        """The fields every generation request carries, without those left at their default."""
        out: dict[str, Any] = {}
        for key in ("max_tokens", "temperature", "top_p", "seed", "stop", "logit_bias"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    def fanned(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """`n` requests for `n` choices: seed `s + i` where a seed is given (taken mod 2**64 by the runtime)."""
        if self.seed is None:
            return [dict(body) for _ in range(self.choices)]
        return [{**body, "seed": self.seed + i} for i in range(self.choices)]


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    prediction: dict[str, Any] | None = None     # predicted outputs only speed a reply up: ignored
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[Literal["text"]] | None = None
    audio: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, choice: Any) -> str | dict[str, Any] | None:
        return None if choice is None else generation.tool_choice(choice)

    @model_validator(mode="after")
    def _chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        if self.tool_choice is not None:
            try:
                generation.choice_among(self.tool_choice, {t.function.name for t in self.tools or []})
            except ValueError as err:
                raise ValueError(generation.named("tool_choice", str(err))) from None
        _nothing_or(self.audio, "audio", "audio output is not supported")
        _nothing_or(self.web_search_options, "web_search_options", "web search is not supported")
        _nothing_or(self.functions, "functions", "deprecated by OpenAI and not supported: send tools")
        _nothing_or(self.function_call, "function_call", "deprecated by OpenAI and not supported: send tool_choice")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def generation_requests(self) -> list[dict[str, Any]]:
        out = self.sampling()
        if self.max_completion_tokens is not None:
            out["max_tokens"] = self.max_completion_tokens
        out["messages"] = [m.wire() for m in self.messages]
        if self.logprobs:
            out["logprobs"] = True
            if self.top_logprobs:
                out["top_logprobs"] = self.top_logprobs
        if self.tools:
            out["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
            if self.tool_choice is not None:
                out["tool_choice"] = self.tool_choice
        if self.response_format is not None and (fmt := self.response_format.wire()) is not None:
            out["response_format"] = fmt
        return self.fanned(out)


def _prompts(prompt: Any) -> list[str]:
    """A string, or a list of 1 to MAX_PROMPTS strings; token ids are refused with the way out."""
    if isinstance(prompt, str):
        return [prompt]
    items = prompt if isinstance(prompt, list) else []
    if items and all(isinstance(p, list) or (isinstance(p, int) and not isinstance(p, bool)) for p in items):
        raise ValueError("token-id prompts are not supported; send the text (lm-eval-harness: "
                         "tokenized_requests=False)")
    if not isinstance(prompt, list) or not all(isinstance(p, str) for p in prompt):
        raise ValueError("must be a string or a list of strings")
    if not 1 <= len(prompt) <= MAX_PROMPTS:
        raise ValueError(f"1 to {MAX_PROMPTS} prompts per request, got {len(prompt)}")
    return prompt


class CompletionRequest(_Request):
    least_tokens: ClassVar[int] = 0
    prompt: Any
    max_tokens: int | None = Field(default=None, ge=0)
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt: Any) -> list[str]:
        return _prompts(prompt)

    @model_validator(mode="after")
    def _completion(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.choices:
            raise ValueError("best_of: only equal to n (ember does not rank candidates)")
        if self.suffix:
            raise ValueError("suffix: insertion is not supported")
        if self.max_tokens == 0 and not (self.echo and not self.stream):
            raise ValueError("max_tokens: 0 only with echo: true (the prompt's logprobs alone), not streamed")
        if len(self.prompts) * self.choices > MAX_CHOICES:
            raise ValueError(f"n: prompts times n is at most {MAX_CHOICES}")
        return self

    @property
    def prompts(self) -> list[str]:
        return self.prompt   # made a list by its validator

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def prompt_only(self) -> bool:
        """`max_tokens: 0` with echo: one token is asked for and dropped (the convention wants at least one)."""
        return self.max_tokens == 0

    def generation_requests(self) -> list[dict[str, Any]]:
        """One request per (prompt, choice), prompt-major: choice `p * n + i` as OpenAI numbers them."""
        out = self.sampling()
        if self.prompt_only:
            out["max_tokens"] = 1
        if self.logprobs is not None:
            out["logprobs"] = True
            if self.logprobs:
                out["top_logprobs"] = self.logprobs
        if self.echo:
            out["echo"] = True
        return [body for p in self.prompts for body in self.fanned({**out, "prompt": p})]


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# ----------------------------------------------------------------------------------------------- V2 generate


class GenerateParameters(_Lenient, _SamplingChecks):
    """The parameters ember knows; others (a backend's own) are accepted and ignored."""

    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=TEMPERATURE[0], le=TEMPERATURE[1])
    top_p: float | None = Field(default=None, gt=TOP_P[0], le=TOP_P[1])
    seed: int | None = None
    stop: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = None     # Triton clients send it; the route decides

    @model_validator(mode="after")
    def _top(self) -> GenerateParameters:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self


class GenerateRequest(BaseModel):
    """KServe V2 / Triton generate extension: `{"text_input": ..., "parameters": {...}}`. As Triton does, other
    top-level fields are parameters: the known ones are taken (a field given at both places must agree), the
    rest ignored."""

    model_config = ConfigDict(extra="ignore")

    text_input: str
    parameters: GenerateParameters = GenerateParameters()

    @model_validator(mode="before")
    @classmethod
    def _lift(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("parameters", {}), dict):
            return data
        params = dict(data.get("parameters") or {})
        for key in GenerateParameters.model_fields:
            if key in data:
                if key in params and params[key] != data[key]:
                    raise ValueError(f"{key}: given at the top level and in parameters, with different values")
                params[key] = data[key]
        return {**{k: v for k, v in data.items() if k not in GenerateParameters.model_fields},
                "parameters": params}

    def generation_request(self) -> dict[str, Any]:
        out = self.parameters.model_dump(exclude_none=True, exclude={"stream"})
        if not self.parameters.logit_bias:
            out.pop("logit_bias", None)
        if not self.parameters.logprobs:
            out.pop("logprobs", None)
            out.pop("top_logprobs", None)
        out["prompt"] = self.text_input
        return out
