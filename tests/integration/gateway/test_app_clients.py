"""The OpenAI features apps send (issue 29 §5), through the clients apps use: the real `openai` SDK, LangChain's
`ChatOpenAI` and litellm, against a real uvicorn server over FakeService (whose `chatter` calls the tools the
last message names, answers a JSON document of a response_format's schema, and gives log-probabilities).

Every test runs offline: connections to anything but the loopback are refused (litellm reads its model cost map
from the package with LITELLM_LOCAL_MODEL_COST_MAP=True; LangChain sends no traces unless told to)."""

from __future__ import annotations

import importlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field

from ember.gateway.app import create_app
from ember.jobs.store import JobStore
from ember.metrics import Metrics
from ember.testing.asgi import ThreadedServer
from ember.testing.service import FakeService

WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class Capital(BaseModel):
    """A country's capital."""

    city: str = Field(description="the city")
    population_millions: float


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any connection off this machine is refused and fails the test (also when a client swallows the error):
    the clients must work offline."""
    connect, tried = socket.socket.connect, []

    def guarded(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            tried.append(address)
            raise ConnectionRefusedError(f"{address}: tests run offline")
        return connect(self, address)

    def resolve(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in (None, "127.0.0.1", "::1", "localhost", b"127.0.0.1", b"localhost"):
            tried.append(host)
            raise socket.gaierror(socket.EAI_NONAME, f"{host}: tests run offline")
        return getaddrinfo(host, *args, **kwargs)

    getaddrinfo = socket.getaddrinfo
    monkeypatch.setattr(socket.socket, "connect", guarded)
    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    yield
    assert not tried, f"a client tried to reach {tried}"


@pytest.fixture
def base_url(tmp_path: Path) -> Iterator[str]:
    with JobStore(tmp_path / "jobs.sqlite3", max_queued=10, result_ttl_s=60) as jobs, \
            ThreadedServer(create_app(FakeService(jobs=jobs), Metrics())) as server:
        yield f"{server.url}/v1"


@pytest.fixture
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base_url, api_key="-", max_retries=0) as c:
        yield c


# ------------------------------------------------------------------------------------------------------- openai


def test_openai_chat_with_tools_and_the_tool_loop(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "developer", "content": "use tools"},
                     {"role": "user", "content": [{"type": "text", "text": "get_weather in Paris?"}]}]
    out = client.chat.completions.create(model="chatter", messages=messages, tools=[WEATHER], tool_choice="auto",
                                         parallel_tool_calls=False, temperature=None)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]  # type: ignore[index]
    assert call.type == "function" and call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "get_weather in Paris?"}  # type: ignore[union-attr]
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = client.chat.completions.create(model="chatter", messages=messages, tools=[WEATHER])
    assert again.choices[0].message.content == "the tool said sunny " and again.choices[0].finish_reason == "stop"


def test_openai_structured_output_parses_into_the_model(client: openai.OpenAI) -> None:
    out = client.chat.completions.parse(model="chatter", response_format=Capital,
                                        messages=[{"role": "user", "content": "Paris"}])
    assert out.choices[0].message.parsed == Capital(city="Paris", population_millions=5.0)
    plain = client.chat.completions.create(model="chatter", messages=[{"role": "user", "content": "x"}],
                                           response_format={"type": "json_object"})
    assert json.loads(plain.choices[0].message.content or "") == {"text": "x"}


def test_openai_logprobs_and_n(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="chatter", messages=[{"role": "user", "content": "a b"}],
                                         logprobs=True, top_logprobs=2, n=2, seed=1, logit_bias={"7": 1})
    assert [c.index for c in out.choices] == [0, 1]
    content = out.choices[1].logprobs.content  # type: ignore[union-attr]
    assert [t.token for t in content] == ["a ", "b "]  # type: ignore[union-attr]
    assert [t.token for t in content[0].top_logprobs] == ["a ", "alt1"]  # type: ignore[index]
    assert out.usage is not None and out.usage.completion_tokens == 4


def test_openai_streams_tool_calls_and_n_choices(client: openai.OpenAI) -> None:
    clock: Any = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    with client.chat.completions.stream(model="chatter", tools=[WEATHER, clock],
                                        messages=[{"role": "user", "content": "get_weather and get_time"}]) as s:
        final = s.get_final_completion()
    calls = final.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert final.choices[0].finish_reason == "tool_calls"
    texts = ["", ""]
    for chunk in client.chat.completions.create(model="chatter", messages=[{"role": "user", "content": "x y"}],
                                                n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == ["x y ", "x y "]


def test_openai_completions_echo_logprobs_and_model_cards(client: openai.OpenAI) -> None:
    out = client.completions.create(model="chatter", prompt="a b", echo=True, logprobs=1, max_tokens=1)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens == ["a ", "b", "a "] and lp.token_logprobs == [None, -0.5, -0.25]
    assert lp.text_offset == [0, 2, 3] and out.choices[0].text == "a ba "
    assert client.models.retrieve("chatter").id == "chatter"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


# ---------------------------------------------------------------------------------------------------- LangChain


@pytest.fixture
def chat_model(base_url: str) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(model="chatter", base_url=base_url, api_key="-", max_retries=0)


def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


def test_langchain_bind_tools(chat_model: Any) -> None:
    question = importlib.import_module("langchain_core.messages").HumanMessage("get_weather in Paris?")
    msg = chat_model.bind_tools([get_weather]).invoke([question])
    assert msg.tool_calls == [{"name": "get_weather", "args": {"city": "get_weather in Paris?"},
                               "id": "call_0_get_weather", "type": "tool_call"}]
    messages_mod = importlib.import_module("langchain_core.messages")
    answer = chat_model.bind_tools([get_weather]).invoke(
        [question, msg, messages_mod.ToolMessage(content="sunny", tool_call_id=msg.tool_calls[0]["id"])])
    assert answer.content == "the tool said sunny " and answer.tool_calls == []
    chunks = list(chat_model.bind_tools([get_weather], tool_choice="get_weather").stream("Paris?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("get_weather", {"city": "Paris?"})]


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(chat_model: Any, method: str) -> None:
    structured = chat_model.with_structured_output(Capital, method=method)
    if method == "json_mode":   # the schema is the prompt's business: the fake answers {"text": ...}
        with pytest.raises(Exception, match="city"):
            structured.invoke("Paris")
        return
    assert structured.invoke("Paris") == Capital(city="Paris", population_millions=5.0)


# ------------------------------------------------------------------------------------------------------ litellm


@pytest.fixture
def litellm(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # else its import fetches the cost map
    monkeypatch.setenv("LITELLM_TELEMETRY", "False")
    return importlib.import_module("litellm")


def test_litellm_completion_tools_and_stream(litellm: ModuleType, base_url: str) -> None:
    kw: dict[str, Any] = {"model": "openai/chatter", "api_base": base_url, "api_key": "-", "num_retries": 0}
    out = litellm.completion(messages=[{"role": "user", "content": "one two"}], temperature=0, **kw)
    assert out.choices[0].message.content == "one two " and out.usage.completion_tokens == 2
    called = litellm.completion(messages=[{"role": "user", "content": "get_weather now"}], tools=[WEATHER], **kw)
    assert called.choices[0].message.tool_calls[0].function.name == "get_weather"
    text = "".join(c.choices[0].delta.content or "" for c in litellm.completion(
        messages=[{"role": "user", "content": "a b c"}], stream=True, **kw))
    assert text == "a b c "
