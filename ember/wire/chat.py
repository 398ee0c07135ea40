"""Wire models of the OpenAI text-generation APIs: `/v1/chat/completions` and `/v1/completions`.

Requests are validated here once (errors name the field); what an LLM instance needs of them is one
JSON object (`generation_request`), the `request` input of the `llm` runtime's contract convention:
`{"messages": [...]}` or `{"prompt": "..."}` with `max_tokens`, `temperature`, `top_p`, `seed`, `stop`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Role = Literal["system", "user", "assistant"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None                                   # accepted and ignored, as OpenAI's
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)

    @field_validator("n")
    @classmethod
    def _one(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 non-empty stop strings")
        return stop

    @model_validator(mode="after")
    def _penalties(self) -> _Request:
        if self.frequency_penalty or self.presence_penalty:
            raise ValueError("frequency_penalty and presence_penalty are not supported (only 0)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        return self

    def sampling(self) -> dict[str, Any]:
        out: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p}
        for key in ("max_tokens", "seed", "stop"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Role
    content: str
    name: str | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def generation_request(self) -> dict[str, Any]:
        out = self.sampling()
        if self.max_completion_tokens is not None:
            out["max_tokens"] = self.max_completion_tokens
        out["messages"] = [{"role": m.role, "content": m.content} for m in self.messages]
        return out


class CompletionRequest(_Request):
    prompt: str | list[str]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and len(prompt) != 1:
            raise ValueError("one prompt per request (a string, or a list of one string)")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    def generation_request(self) -> dict[str, Any]:
        out = self.sampling()
        out["prompt"] = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        return out


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class GenerateParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None     # Triton clients send it; the route decides


class GenerateRequest(BaseModel):
    """KServe V2 / Triton generate extension: `{"text_input": ..., "parameters": {...}}`."""

    model_config = ConfigDict(extra="forbid")

    text_input: str
    parameters: GenerateParameters = GenerateParameters()

    @field_validator("parameters")
    @classmethod
    def _stops(cls, parameters: GenerateParameters) -> GenerateParameters:
        stop = parameters.stop
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop: up to 4 non-empty stop strings")
        return parameters

    def generation_request(self) -> dict[str, Any]:
        out = self.parameters.model_dump(exclude_none=True, exclude={"stream"})
        out["prompt"] = self.text_input
        return out
