"""docs/examples/own-gguf, as docs/llm.md walks through it: a GGUF without a chat template (a base model's
conversion; here a tiny random-weight one) pushed with `ember store push`, served by `ember serve` with the
example's contract and its own chat template: the warm-up (a chat) passes at deploy, a prompt past the context is
refused before any instance starts, a chat is served, and the openai SDK's `tools` and LangChain's `bind_tools`
get calls in the template's format (the grammar makes the call; the random weights' text means nothing, so only
the request path is asserted)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from ember.store import StoreConfig
from ember.testing.gguf_models import write_model
from ember.testing.server import EmberServer

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "own-gguf"
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ember-e2e-gguf-", dir="/tmp"))   # Unix socket paths are short
    yield path
    memory = StoreConfig(root=path / "store").memory_dir
    shutil.rmtree(path, ignore_errors=True)
    if memory is not None:
        shutil.rmtree(memory, ignore_errors=True)


@pytest.fixture
def server(base: Path) -> Iterator[EmberServer]:
    gguf = write_model(base / "my-base.gguf", "llama", chat_template=False)
    subprocess.run([sys.executable, "-m", "ember", "store", "--root", str(base / "store"), "--no-memory", "--quiet",
                    "push", str(gguf), "my-base:1"], check=True, capture_output=True, timeout=120)
    models = shutil.copytree(EXAMPLE, base / "models")
    with EmberServer(base / "state", "--models", str(models), "--store-root", str(base / "store")) as running:
        yield running


def test_a_pushed_gguf_serves_chat_and_tools_with_the_contracts_template(server: EmberServer) -> None:
    (model,) = server.status()["models"]
    assert model["name"] == "my-base" and model["state"] == "READY"   # its warm-up, a chat, passed at deploy
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    # A prompt past the context: refused by the gateway's check (the stored GGUF's head) before any instance.
    with pytest.raises(openai.BadRequestError, match="exceeds the context"):
        client.chat.completions.create(model="my-base", messages=[{"role": "user", "content": "word " * 3000}])
    assert server.instances("my-base") == []
    chat = client.chat.completions.create(model="my-base", messages=ASK, max_tokens=4, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage is not None
    assert chat.usage.prompt_tokens > len(ASK[0]["content"].split())   # the template's turns around the question
    called = client.chat.completions.create(model="my-base", messages=ASK, tools=[WEATHER],
                                            tool_choice="required", max_tokens=128, temperature=0)
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Oslo", "Rome")

    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "mild"

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="my-base", temperature=0,
                     max_tokens=128, max_retries=0)
    answer = llm.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Oslo?")
    assert [c["name"] for c in answer.tool_calls] == ["get_weather"]
