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
    from ember.testing.hf_models import tiny_llama_hf

    tmp = tmp_path_factory.mktemp("vllm")
    weights = tiny_llama_hf(tmp / "tiny-llama")
    models = tmp / "models"
    models.mkdir()
    (models / "tiny-vllm.yaml").write_text(json.dumps({
        "name": "tiny-vllm", "runtime": "vllm", "weights": str(weights),
        "inputs": [{"name": "request", "datatype": "BYTES", "shape": [1]}],
        "outputs": [{"name": n, "datatype": "INT64" if n.endswith("tokens") else "BYTES", "shape": [1]}
                    for n in OUTPUTS],
        "resources": {"memory_mb": 4096}, "batching": {"max_batch_size": 1},
        "scaling": {"min_scale": 0, "max_scale": 1, "target_concurrency": 8, "max_concurrency": 8,
                    "pause_after_s": 3, "max_idle_s": 8},
        "warmup": {"requests": 1, "inputs": {"request": ['{"prompt": "Hi", "max_tokens": 1}']}},
        "options": {"kv_cache_gb": 0.25, "max_model_len": 1024}}))
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
