"""The vllm runtime through a real `ember serve`: OpenAI chat (streamed) and completions, and KServe V2 generate,
from a model scaled to zero (the first request is served from the vllm zygote's fork), and back to zero after its
keep-alive, the next request again from the zygote. Needs the vllm environment
(`ember env build vllm`): skipped with that reason otherwise. A random-weight tiny Llama (ember.testing.hf_models):
the protocol is checked, not the words."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ember.environments.registry import Environments
from ember.testing.server import EmberServer

ENV = Environments().status("vllm")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not ENV.built, reason=f"vllm runtime: {ENV.reason or 'not built'}")]
OUTPUTS = ("text", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "logprobs")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmberServer]:
    from ember.testing.gguf_models import CHATML_TOOLS
    from ember.testing.hf_models import tiny_llama_hf, vllm_contract_data

    tmp = tmp_path_factory.mktemp("vllm")
    models = tmp / "models"
    models.mkdir()
    for name, weights in (("tiny-vllm", tiny_llama_hf(tmp / "tiny-llama")),
                          ("tiny-vllm-tools", tiny_llama_hf(tmp / "tiny-tools", chat_template=CHATML_TOOLS))):
        (models / f"{name}.yaml").write_text(json.dumps(vllm_contract_data(
            name, weights, (*OUTPUTS, "tool_calls"),
            resources={"memory_mb": 4096}, batching={"max_batch_size": 1},
            scaling={"min_scale": 0, "max_scale": 1, "target_concurrency": 8, "max_concurrency": 8,
                     "pause_after_s": 3, "max_idle_s": 8},
            warmup={"requests": 1, "inputs": {"request": ['{"prompt": "Hi", "max_tokens": 1}']}})))
    with EmberServer(tmp / "state", "--models", str(models), "--no-examples", "--log-level", "warning",
                     "--sandbox", "off", "--request-timeout-s", "300") as s:
        yield s


def chat(client: httpx.Client) -> tuple[str | None, list[dict[str, Any]]]:
    """A streamed greedy chat of 5 tokens: the rung that served it and its events."""
    body = {"model": "tiny-vllm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    events, rung = [], None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(": ember-rung "):
                rung = line.split()[-1]
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    return rung, events


def test_openai_and_v2_generate_from_zero_and_back(server: EmberServer) -> None:
    with httpx.Client(base_url=server.url, timeout=300) as client:
        rung, events = chat(client)
        assert rung == "zygote"   # scaled to zero, no template for vllm: the zygote's fork served it
        assert events[-1]["usage"]["completion_tokens"] == 5
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"

        r = client.post("/v1/completions", json={"model": "tiny-vllm", "prompt": "Once upon", "max_tokens": 4,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4

        r = client.post("/v2/models/tiny-vllm/generate", json={"text_input": "Once upon", "parameters": {
            "max_tokens": 4, "temperature": 0}})
        assert r.status_code == 200, r.text
        same = client.post("/v1/completions", json={"model": "tiny-vllm", "prompt": "Once upon", "max_tokens": 4,
                                                    "temperature": 0})
        assert r.json()["text_output"] == same.json()["choices"][0]["text"]

        r = client.post("/v1/chat/completions", json={"model": "tiny-vllm", "max_tokens": 5000,
                                                      "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens: 5000 exceeds")

        deadline = time.monotonic() + 90   # max_idle_s 8: the instance, engine and all, goes
        while server.instances("tiny-vllm") and time.monotonic() < deadline:
            time.sleep(1)
        assert server.instances("tiny-vllm") == []
        rung, events = chat(client)
        assert rung == "zygote" and events[-1]["usage"]["completion_tokens"] == 5


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}


def test_the_openai_client_gets_tool_calls_json_and_prompt_logprobs_from_a_vllm_model(server: EmberServer) -> None:
    """The real `openai` SDK: a required tool call (whole and streamed, as OpenAI streams one), a JSON-schema
    response, a prompt scored by echo with logprobs; a model whose template has no tool format answers tools with a
    400 saying so."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=300, max_retries=0)
    chat = [{"role": "user", "content": "Weather in Paris?"}]
    whole = client.chat.completions.create(model="tiny-vllm-tools", messages=chat, tools=[WEATHER],  # type: ignore
                                           tool_choice="required", max_tokens=64, temperature=0)
    [call] = whole.choices[0].message.tool_calls or []
    assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")

    deltas = list(client.chat.completions.create(model="tiny-vllm-tools", messages=chat, tools=[WEATHER],  # type: ignore
                                                 tool_choice="required", max_tokens=64, temperature=0, stream=True))
    streamed = [c for d in deltas if d.choices for c in d.choices[0].delta.tool_calls or []]
    assert streamed and streamed[0].function.name == "get_weather"
    assert json.loads("".join(c.function.arguments or "" for c in streamed)) == json.loads(call.function.arguments)
    assert [d.choices[0].finish_reason for d in deltas if d.choices][-1] == "tool_calls"

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    answer = client.chat.completions.create(model="tiny-vllm-tools", messages=chat, max_tokens=96, temperature=0,
                                            response_format={"type": "json_schema",  # type: ignore[typeddict-item]
                                                             "json_schema": {"name": "r", "schema": schema}})
    assert isinstance(json.loads(answer.choices[0].message.content or "")["ok"], bool)

    scored = client.completions.create(model="tiny-vllm", prompt="The quick brown fox", echo=True, logprobs=1,
                                       max_tokens=0, temperature=0)   # lm-eval-harness's loglikelihood request
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == "The quick brown fox" and lp is not None and lp.token_logprobs is not None
    assert lp.token_logprobs[0] is None and all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert len(lp.token_logprobs) == scored.usage.prompt_tokens   # type: ignore[union-attr]

    with pytest.raises(openai.BadRequestError, match="has no tool format"):
        client.chat.completions.create(model="tiny-vllm", messages=chat, tools=[WEATHER],  # type: ignore[list-item]
                                       max_tokens=4)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_from_a_vllm_model(server: EmberServer, method: str) -> None:
    """LangChain's `ChatOpenAI.with_structured_output` of a pydantic model, by a JSON schema or a forced tool call:
    the tiny model's answer is noise, but constrained, so it parses into the model."""
    from typing import Literal

    import pydantic
    from langchain_openai import ChatOpenAI

    class Forecast(pydantic.BaseModel):
        city: Literal["Paris", "Oslo"]
        sunny: bool

    chat = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="tiny-vllm-tools",  # type: ignore[arg-type]
                      temperature=0, max_tokens=96, timeout=300, max_retries=0)
    answer = chat.with_structured_output(Forecast, method=method).invoke("Weather in Paris?")
    assert isinstance(answer, Forecast)
